"""Batch-1 single-token decode latency of a gin-configured model, with random weights.

  python -m terra.benchmarks.decode_speed --gin_file=models/dense_800m.gin [--out DIR]

Follows the reference's timing (``trax_reference.md`` §6): a 16-token encoder input,
prefill, a warm-up that compiles and runs a few steps, then timed single-token ``step``
calls with ``block_until_ready``, the first two tokens of each repetition not counted.
Reports the median and minimum seconds per token over all timed tokens.
"""

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from terra import gin_utils
from terra.decoding.decode_step import IncrementalDecoder


@dataclasses.dataclass
class DecodeTiming:
    prefill_s: List[float]
    token_s: List[float]

    @property
    def median_token_s(self) -> float:
        return float(np.median(self.token_s))

    @property
    def min_token_s(self) -> float:
        return float(np.min(self.token_s))

    def summary(self) -> dict:
        return {
            "prefill_median_s": float(np.median(self.prefill_s)),
            "token_median_s": self.median_token_s,
            "token_min_s": self.min_token_s,
            "timed_tokens": len(self.token_s),
        }


_next_token = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def measure_decode(
    decoder: IncrementalDecoder,
    params,
    encoder_input_tokens,
    *,
    n_tokens: int = 12,
    n_skip: int = 2,
    n_warmup: int = 4,
    repeats: int = 3,
) -> DecodeTiming:
    """Times ``prefill`` and each greedy ``step`` (``n_tokens`` per repetition, the first
    ``n_skip`` of each not counted)."""
    if n_tokens > decoder.max_decode_length:
        raise ValueError(f"n_tokens={n_tokens} exceeds max_decode_length={decoder.max_decode_length}.")
    inputs = jnp.asarray(encoder_input_tokens, jnp.int32)
    batch = inputs.shape[0]

    def run(n: int, timed: bool, timing: DecodeTiming):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(decoder.prefill(params, inputs))
        if timed:
            timing.prefill_s.append(time.perf_counter() - t0)
        token = jnp.zeros((batch,), jnp.int32)
        for i in range(n):
            t0 = time.perf_counter()
            logits, cache = decoder.step(params, cache, token)
            logits.block_until_ready()
            if timed and i >= n_skip:
                timing.token_s.append(time.perf_counter() - t0)
            token = _next_token(logits)

    timing = DecodeTiming([], [])
    run(min(n_warmup, decoder.max_decode_length), False, timing)
    for _ in range(repeats):
        run(n_tokens, True, timing)
    return timing


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gin_utils.add_gin_flags(parser)
    parser.add_argument("--input_length", type=int, default=16, help="Encoder input tokens (reference: 16).")
    parser.add_argument("--tokens", type=int, default=12, help="Steps per repetition (first two not timed).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="Directory for decode_speed.json.")
    args = gin_utils.parse_flags(parser, argv)
    if not args.gin_file:
        gin_utils.parse_gin(["models/tiny.gin"], args.gin_bindings)
        args.gin_file = ["models/tiny.gin"]
    model = gin_utils.build("terra.models.EncoderDecoderModel")
    cfg = model.config
    params = model.init_params(jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(args.seed)
    inputs = rng.integers(2, cfg.vocab_size, size=(args.batch_size, args.input_length))
    decoder = model.decoder(max(2 * args.input_length, args.tokens))
    timing = measure_decode(decoder, params, inputs, n_tokens=args.tokens, repeats=args.repeats)
    row = {
        "config": " + ".join(args.gin_file),
        "params": n_params,
        "batch_size": args.batch_size,
        "input_length": args.input_length,
        **timing.summary(),
        "backend": jax.default_backend(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    print(f"{'config':<34} {'params':>12} {'prefill ms':>11} {'ms/token (median)':>18} {'ms/token (min)':>15}")
    print(
        f"{row['config']:<34} {n_params:>12,d} {row['prefill_median_s'] * 1e3:>11.2f} "
        f"{row['token_median_s'] * 1e3:>18.3f} {row['token_min_s'] * 1e3:>15.3f}"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_speed.json"), "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)
