"""Training throughput (tokens per second)
and compiled memory of the jitted train step, dense against sparse, at a small size.

Each row builds a model from its gin config at the size below, creates the train state
(Adafactor, as the trainer) from random weights drawn leaf by leaf (the step's time does not
depend on the values, and the model's jitted initialiser would be one more program to compile:
seconds at these sizes, more at 800M), compiles ``train_step`` once with the state donated, and
times steps on fixed random batches: synthetic input, so it reads no data and needs no TensorFlow
(the input pipeline is measured separately by ``terra.benchmarks.input_pipeline``). Tokens per
second counts inputs + targets of every example. Sparse layers train with their masks over all
units (paper §3: the speed-up is for decoding), so training is not expected to be faster.
Writes ``train_speed.{json,md}``. Run by ``terra-bench train``.
"""

import time
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from terra.benchmarks import decode_speed, report
from terra.benchmarks.presets import TRAIN_SPEED_ROWS as ROWS
from terra.benchmarks.presets import TRAIN_SPEED_SMALL_SIZE as SMALL_SIZE
from terra.benchmarks.presets import TRAIN_SPEED_SMOKE_SIZE as SMOKE_SIZE
from terra.gin_config import parsing
from terra.training import metrics as metrics_lib
from terra.training import optimizers
from terra.training.train_state import TrainState
from terra.training.train_step import train_step


def measure(
    gin_files: Sequence[str],
    bindings: Sequence[str],
    *,
    size: Sequence[str],
    batch_size: int,
    inputs: int,
    targets: int,
    steps: int,
) -> dict:
    model = parsing.parse_model(gin_files, [*size, *bindings])
    return measure_model(model, batch_size=batch_size, inputs=inputs, targets=targets, steps=steps)


def measure_model(model, *, batch_size: int, inputs: int, targets: int, steps: int) -> dict:
    """:func:`measure` for a model already built."""
    tx = optimizers.adafactor().transform
    params = decode_speed.random_params(model, 0)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    targets_tokens = rng.integers(2, vocab, (batch_size, targets)).astype(np.int32)
    batch = {
        "encoder_input_tokens": jnp.asarray(rng.integers(2, vocab, (batch_size, inputs)).astype(np.int32)),
        "decoder_target_tokens": jnp.asarray(targets_tokens),
        "decoder_input_tokens": jnp.asarray(
            np.concatenate([np.zeros((batch_size, 1), np.int32), targets_tokens[:, :-1]], 1)
        ),
        "decoder_loss_weights": jnp.ones((batch_size, targets), jnp.int32),
    }
    step = jax.jit(lambda s, b, r: train_step(model, tx, s, b, r), donate_argnums=(0,))
    key = jax.random.key(1)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    compile_s = time.perf_counter() - t0
    flops = compiled_flops(compiled)
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
        # XLA's count for the whole step (forward, backward, optimizer); None where it has none.
        "flops_per_step": flops,
        "final_loss": float(m["loss"]),
    }


def compiled_flops(compiled) -> Optional[float]:
    """XLA's FLOP count of a compiled function (2 per multiply-add), or None where the backend
    gives none."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # a backend without cost analysis: the count is optional
        return None
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) and analysis else analysis
    flops = analysis.get("flops") if isinstance(analysis, dict) else None
    return float(flops) if flops and flops > 0 else None


def markdown(rows: List[dict], note: str) -> str:
    lines = [
        "### training throughput",
        "",
        note,
        "",
        "| model | params | step time | tokens/s | compiled memory |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        memory = f"{r['compiled_memory_bytes'] / 1e6:,.1f} MB" if r["compiled_memory_bytes"] else "n/a"
        lines.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['seconds_per_step'] * 1e3:,.0f} ms | "
            f"{r['tokens_per_second']:,.0f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def run(
    out_dir: str,
    *,
    rows: Sequence[str] = (),
    batch_size: int = 8,
    inputs: int = 256,
    targets: int = 64,
    steps: int = 5,
    small: bool = False,
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
) -> List[dict]:
    """Times each of ``rows`` (keys of :data:`ROWS`; default all); ``gin_files`` and
    ``gin_bindings`` are applied to every row after its own. Writes ``train_speed.{json,md}``."""
    size = list(SMALL_SIZE) + (list(SMOKE_SIZE) if small else [])
    results = []
    for name, gin_file, bindings in (ROWS[k] for k in (rows or list(ROWS))):
        bindings = bindings + (["TransformerConfig.d_ff = 256"] if small else [])
        row = {
            "name": name,
            "gin_file": gin_file,
            **measure(
                [gin_file, *gin_files],
                [*bindings, *gin_bindings],
                size=size,
                batch_size=batch_size,
                inputs=inputs,
                targets=targets,
                steps=steps,
            ),
        }
        print(
            f"{name:45s} {row['seconds_per_step'] * 1e3:8.1f} ms/step {row['tokens_per_second']:>10,.0f} tokens/s",
            flush=True,
        )
        results.append(row)
    note = (
        f"Batch {batch_size} x (inputs {inputs} + targets {targets}) tokens; Adafactor; median of "
        f"{steps} steps after one warm-up; {jax.device_count()} {jax.default_backend()} device(s); sizes: "
        + ", ".join(b.split(".")[-1] for b in size[:7])
        + ". Sparse-QKV rows use d_ff 1.5x to match parameters."
    )
    report.write_rows(out_dir, "train_speed", results, note, markdown(results, note))
    return results
