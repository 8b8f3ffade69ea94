"""``python -m terra.benchmarks.train_speed --out DIR``: training throughput (tokens per second)
and compiled memory of the jitted train step, dense against sparse, at a small size.

Each row builds a model from its gin config at the size below, creates the train state
(Adafactor, as the trainer), compiles ``train_step`` once with the state donated, and times
steps on fixed random batches (the input pipeline is measured separately by
``terra.benchmarks.input_pipeline``). Tokens per second counts inputs + targets of every
example. Sparse layers train with their masks over all units (paper §3: the speed-up is for
decoding), so training is not expected to be faster. Writes ``train_speed.{json,md}``.
"""

import argparse
import time
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from terra import gin_utils
from terra.benchmarks import report
from terra.training import metrics as metrics_lib
from terra.training import optimizers
from terra.training.train_state import TrainState
from terra.training.train_step import train_step

# 6+6 layers, d_model 512, d_ff 2048 (N = 32 blocks of 64), 8 heads, a 4,100-id vocabulary.
SMALL_SIZE = [
    "TransformerConfig.vocab_size = 4100",
    "TransformerConfig.d_model = 512",
    "TransformerConfig.d_ff = 2048",
    "TransformerConfig.n_heads = 8",
    "TransformerConfig.n_encoder_layers = 6",
    "TransformerConfig.n_decoder_layers = 6",
    "TransformerConfig.max_len = 512",
    "SparseFeedForward.ff_sparsity = 64",
    "SparseQKVAttention.attention_sparsity = 8",
    "SparseQueryCrossAttention.attention_sparsity = 8",
    "SparseLossLogits.loss_sparsity = 4",
]
# --small: seconds, for the smoke test.
SMOKE_SIZE = [
    "TransformerConfig.d_model = 64",
    "TransformerConfig.n_heads = 4",
    "TransformerConfig.n_encoder_layers = 1",
    "TransformerConfig.n_decoder_layers = 1",
    "SparseQKVAttention.attention_sparsity = 4",
    "SparseQueryCrossAttention.attention_sparsity = 4",
]
ROWS = {  # key: (name, model config, bindings)
    "dense": ("dense", "models/dense_800m.gin", ["TransformerConfig.d_ff = 2048"]),
    "sparse_ff": ("Sparse FF", "models/sparse_ff_800m.gin", ["TransformerConfig.d_ff = 2048"]),
    "scaling": ("Sparse FF+QKV+loss (Scaling Transformer)", "models/sparse_ff_qkv_loss4_800m.gin", ["TransformerConfig.d_ff = 3072"]),
    # Reversible, two decoder attentions over [encoder | decoder], SRU; Sparse FF+QKV+loss 4.
    "terraformer": ("Terraformer", "models/terraformer_800m.gin", ["TransformerConfig.d_ff = 3072", "TransformerConfig.max_len = 512"]),
}


def measure(gin_file: str, bindings: Sequence[str], *, size: Sequence[str], batch_size: int, inputs: int, targets: int,
            steps: int) -> dict:
    gin_utils.parse_gin([gin_file], list(size) + list(bindings))
    model = gin_utils.build_model()
    tx = optimizers.adafactor().transform
    params = model.init_params(jax.random.key(0))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    targets_tokens = rng.integers(2, vocab, (batch_size, targets)).astype(np.int32)
    batch = {
        "encoder_input_tokens": jnp.asarray(rng.integers(2, vocab, (batch_size, inputs)).astype(np.int32)),
        "decoder_target_tokens": jnp.asarray(targets_tokens),
        "decoder_input_tokens": jnp.asarray(np.concatenate([np.zeros((batch_size, 1), np.int32), targets_tokens[:, :-1]], 1)),
        "decoder_loss_weights": jnp.ones((batch_size, targets), jnp.int32),
    }
    step = jax.jit(lambda s, b, r: train_step(model, tx, s, b, r), donate_argnums=(0,))
    key = jax.random.key(1)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    compile_s = time.perf_counter() - t0
    state, m = compiled(state, batch, key)  # warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch, key)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    return {
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "seconds_per_step": seconds,
        "tokens_per_second": batch_size * (inputs + targets) / seconds,
        "compiled_memory_bytes": metrics_lib.compiled_memory_bytes(compiled),
        "compile_seconds": compile_s,
        "final_loss": float(m["loss"]),
    }


def markdown(rows: List[dict], note: str) -> str:
    lines = ["### training throughput", "", note, "",
             "| model | params | step time | tokens/s | compiled memory |", "|---|---|---|---|---|"]
    for r in rows:
        memory = f"{r['compiled_memory_bytes'] / 1e6:,.1f} MB" if r["compiled_memory_bytes"] else "n/a"
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['seconds_per_step'] * 1e3:,.0f} ms | "
                     f"{r['tokens_per_second']:,.0f} | {memory} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m terra.benchmarks.train_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/train_speed")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--targets", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    parser.add_argument("--small", action="store_true", help="a tiny size, for a smoke test")
    parser.add_argument("--rows", action="append", choices=sorted(ROWS), help="rows to run (repeatable; default all)")
    args = parser.parse_args(argv)
    size = list(SMALL_SIZE) + (list(SMOKE_SIZE) if args.small else [])
    results = []
    for name, gin_file, bindings in (ROWS[k] for k in (args.rows or list(ROWS))):
        bindings = bindings + (["TransformerConfig.d_ff = 256"] if args.small else [])
        row = {"name": name, "gin_file": gin_file,
               **measure(gin_file, bindings, size=size, batch_size=args.batch_size, inputs=args.inputs, targets=args.targets, steps=args.steps)}
        print(f"{name:45s} {row['seconds_per_step'] * 1e3:8.1f} ms/step {row['tokens_per_second']:>10,.0f} tokens/s", flush=True)
        results.append(row)
    note = (f"Batch {args.batch_size} x (inputs {args.inputs} + targets {args.targets}) tokens; Adafactor; median of "
            f"{args.steps} steps after one warm-up; {jax.device_count()} {jax.default_backend()} device(s); sizes: "
            + ", ".join(b.split('.')[-1] for b in size[:7]) + ". Sparse-QKV rows use d_ff 1.5x to match parameters.")
    report.write_rows(args.out, "train_speed", results, note, markdown(results, note))
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(main)
