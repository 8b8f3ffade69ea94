"""The quick start behind ``make run``: build a model from gin, generate, and time decoding.

  python -m terra.quickstart [--gin_file=models/tiny.gin] [--gin.NAME=VALUE ...]

Until the trainer and the embedded corpus land, this runs the whole decode path on a
randomly initialised model: a batch of padded encoder inputs, greedy and temperature
generation through the jitted prefill/step contract, and batch-1 per-token latency.
"""

import argparse
from typing import List, Optional

import jax
import numpy as np

from terra import gin_utils
from terra.benchmarks.decode_speed import measure_decode


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gin_utils.add_gin_flags(parser)
    parser.add_argument("--batch_size", type=int, default=3)
    parser.add_argument("--input_length", type=int, default=16)
    parser.add_argument("--max_decode_length", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = gin_utils.parse_flags(parser, argv)
    if not args.gin_file:
        args.gin_file = ["models/tiny.gin"]
        gin_utils.parse_gin(args.gin_file, args.gin_bindings)
    model = gin_utils.build("terra.models.EncoderDecoderModel")
    cfg = model.config
    params = model.init_params(jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"terra quick start: {' + '.join(args.gin_file)}")
    print(
        f"  encoder-decoder, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, d_model {cfg.d_model}, "
        f"d_ff {cfg.d_ff}, {cfg.n_heads} heads, vocab {cfg.vocab_size}: {n_params:,d} parameters (random init)"
    )

    # Rows of different real lengths, padded with 0 at the end, as a data pipeline emits them.
    rng = np.random.default_rng(args.seed)
    inputs = rng.integers(2, cfg.vocab_size, size=(args.batch_size, args.input_length)).astype(np.int32)
    for row in range(1, args.batch_size):
        inputs[row, args.input_length - 2 * row :] = cfg.pad_id
    for name, temperature in (("greedy", 0.0), ("temperature 0.5", 0.5)):
        out = model.predict(
            params, inputs, max_decode_length=args.max_decode_length, temperature=temperature, seed=args.seed
        )
        print(f"\n{name} generation ({args.batch_size} rows, up to {args.max_decode_length} tokens, EOS={cfg.eos_id}):")
        for row in range(args.batch_size):
            print(f"  row {row}: {out.tokens[row, : out.lengths[row]].tolist()}")

    timing = measure_decode(model.decoder(args.max_decode_length), params, inputs[:1], n_tokens=min(12, args.max_decode_length))
    summary = timing.summary()
    print("\nbatch-1 decode latency (jitted single-token step, cache donated):")
    print(f"  prefill (encode {args.input_length} tokens + build caches): {summary['prefill_median_s'] * 1e3:8.3f} ms")
    print(f"  per token, median over {summary['timed_tokens']} tokens:        {summary['token_median_s'] * 1e3:8.3f} ms")
    print(f"  per token, minimum:                              {summary['token_min_s'] * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)
