"""The accelerator check: the paper's 800M models on whatever accelerator JAX sees.

Two rows, the dense baseline (``models/dense_800m.gin``) and the fully sparse Scaling
Transformer (``models/fully_sparse_800m.gin``), both computing in bfloat16 (parameters stay
float32 in training, as in a run). For each row, on one chip:

- the train step (:func:`terra.benchmarks.train_speed.measure`: Adafactor, the state donated,
  fixed random batches, the median of the timed steps): tokens per second, and the model FLOPs
  utilisation, XLA's FLOP count of the compiled step over its time over the chip's peak dense
  bfloat16 rate (:data:`PEAK_BF16_FLOPS`; a chip not listed gets no MFU);
- batch-1 greedy decode (:func:`terra.benchmarks.decode_speed.measure_decode`, random weights
  as bfloat16 arrays): seconds per token of one ``DecodeSession.step`` call, and inside the jitted loop.

Every train row runs before the decode rows, and ``accelerator_check.json`` is rewritten after
each measurement (``accelerator_check.md``, the printed table, at the end), so a run stopped by
its time limit (``scripts/accelerator_check.sh``) keeps what it measured. :data:`SMOKE` shrinks
everything to seconds, on a CPU too. Imports no TensorFlow: it runs on a host with jax, flax,
optax and orbax only. Run by ``terra-bench accelerator``.
"""

import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from terra import files
from terra.benchmarks import decode_speed, train_speed
from terra.benchmarks.presets import TRAIN_SPEED_SMALL_SIZE, TRAIN_SPEED_SMOKE_SIZE
from terra.decoding.decode_step import IncrementalDecoder
from terra.gin_config import parsing

# Dense bfloat16 FLOP/s of one chip (the vendors' figures without structured sparsity), by a
# substring of ``jax.Device.device_kind``; the first match wins, so specific names come first.
PEAK_BF16_FLOPS: Tuple[Tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("TPU v6 lite", 918e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)

ROWS: Tuple[Tuple[str, str], ...] = (
    ("dense", "models/dense_800m.gin"),
    ("fully sparse", "models/fully_sparse_800m.gin"),
)
BFLOAT16 = "TransformerConfig.dtype = 'bfloat16'"
# The reference's decode protocol: a 16-token encoder input, the first two steps not timed.
DECODE_INPUT_LENGTH = 16
DECODE_SKIP = 2


@dataclasses.dataclass(frozen=True)
class CheckSize:
    """How big the check runs: gin bindings applied to every row after its model config, the
    train batch (``batch_size`` examples of ``inputs`` + ``targets`` tokens) and step count, and
    the decoded tokens per repetition."""

    name: str
    bindings: Tuple[str, ...]
    batch_size: int
    inputs: int
    targets: int
    train_steps: int
    decode_tokens: int
    decode_repeats: int


# The 800M models at their widths: 24+24 layers, d_model 1024, 16 x 640 tokens a step.
FULL = CheckSize(
    "800M", (BFLOAT16,), batch_size=16, inputs=512, targets=128, train_steps=5, decode_tokens=34, decode_repeats=3
)
# terra-bench train's smoke size: seconds on a CPU.
SMOKE = CheckSize(
    "smoke",
    (BFLOAT16, *TRAIN_SPEED_SMALL_SIZE, *TRAIN_SPEED_SMOKE_SIZE, "TransformerConfig.d_ff = 256"),
    batch_size=2,
    inputs=16,
    targets=8,
    train_steps=1,
    decode_tokens=4,
    decode_repeats=1,
)


def peak_bf16_flops(device_kind: str) -> Optional[float]:
    """The chip's dense bfloat16 FLOP/s from :data:`PEAK_BF16_FLOPS`, or None when unknown."""
    for name, flops in PEAK_BF16_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def model_flops_utilization(flops_per_step: Optional[float], seconds_per_step: float, peak: Optional[float]):
    """The fraction of the chip's peak the step's FLOPs reach, or None without a FLOP count or a
    known peak."""
    if not flops_per_step or not peak:
        return None
    return flops_per_step / seconds_per_step / peak


def describe_device() -> Dict[str, object]:
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "peak_bf16_flops": peak_bf16_flops(device.device_kind),
        "jax": jax.__version__,
    }


def train_row(name: str, gin_file: str, model, size: CheckSize, peak: Optional[float]) -> dict:
    """One row's train step: tokens/s and MFU (None without a known peak or a FLOP count)."""
    measured = train_speed.measure_model(
        model,
        batch_size=size.batch_size,
        inputs=size.inputs,
        targets=size.targets,
        steps=size.train_steps,
    )
    mfu = model_flops_utilization(measured["flops_per_step"], measured["seconds_per_step"], peak)
    return {"name": name, "gin_file": gin_file, "measure": "train", **measured, "mfu": mfu}


def decode_row(name: str, gin_file: str, model, size: CheckSize) -> dict:
    """One row's batch-1 greedy decode on random weights held in bfloat16."""
    # Plain bfloat16 arrays: what an accelerator reads (terra.quantization's narrow storage
    # serves the CPU kernels).
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), decode_speed.random_params(model, 0))
    inputs = np.random.default_rng(0).integers(2, model.config.vocab_size, size=(1, DECODE_INPUT_LENGTH))
    decoder = IncrementalDecoder(model.module, max(2 * DECODE_INPUT_LENGTH, size.decode_tokens))
    timing = decode_speed.measure_decode(
        decoder,
        params,
        inputs,
        n_tokens=size.decode_tokens,
        n_skip=DECODE_SKIP,
        n_warmup=DECODE_SKIP,
        repeats=size.decode_repeats,
    )
    return {
        "name": name,
        "gin_file": gin_file,
        "measure": "decode",
        "seconds_per_token": timing.median_token_s,
        # None: the loop's jitter was larger than the difference it measures.
        "seconds_per_token_loop": timing.median_loop_token_s,
        "prefill_seconds": float(np.median(timing.prefill_s)),
    }


def table(device: Dict[str, object], rows: List[dict]) -> str:
    peak = device["peak_bf16_flops"]
    lines = [
        f"accelerator check: {device['device_kind']} ({device['platform']}), peak bf16 "
        + (f"{peak / 1e12:,.0f} TFLOP/s" if peak else "unknown"),
        "",
        "| model | measure | step or token | tokens/s | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["measure"] == "train":
            flops = r["flops_per_step"]
            rate = f"{flops / r['seconds_per_step'] / 1e12:.3g}" if flops else "n/a"
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            lines.append(
                f"| {r['name']} | train step | {r['seconds_per_step'] * 1e3:,.1f} ms | "
                f"{r['tokens_per_second']:,.0f} | {rate} | {mfu} |"
            )
        else:
            loop = r["seconds_per_token_loop"]
            in_loop = f" ({loop * 1e3:,.2f} ms in loop)" if loop is not None else ""
            lines.append(
                f"| {r['name']} | batch-1 decode | {r['seconds_per_token'] * 1e3:,.2f} ms{in_loop} | "
                f"{1 / r['seconds_per_token']:,.0f} | | |"
            )
    return "\n".join(lines) + "\n"


def run(out_dir: str, *, size: CheckSize = FULL, log: Callable[[str], None] = print) -> List[dict]:
    """Measures every row (train steps first, then decoding), rewriting
    ``out_dir/accelerator_check.json`` after each; prints and returns the rows."""
    os.makedirs(out_dir, exist_ok=True)
    device = describe_device()
    start = time.perf_counter()
    log(f"accelerator check ({size.name}) on {device['device_count']} x {device['device_kind']}")
    rows: List[dict] = []
    # Each model is built once (its initializer traced: seconds at 800M), for both its rows.
    models = {gin_file: parsing.parse_model([gin_file], size.bindings) for _, gin_file in ROWS}
    steps = [(train_row, (n, f, models[f], size, device["peak_bf16_flops"])) for n, f in ROWS]
    steps += [(decode_row, (n, f, models[f], size)) for n, f in ROWS]
    for measure, args in steps:
        rows.append(measure(*args))
        elapsed = time.perf_counter() - start
        log(f"  {rows[-1]['name']} {rows[-1]['measure']}: done after {elapsed:,.0f} s")
        record = {
            "device": device,
            "size": dataclasses.asdict(size),
            "elapsed_seconds": elapsed,
            "rows": rows,
        }
        files.write_atomically(os.path.join(out_dir, "accelerator_check.json"), json.dumps(record, indent=2) + "\n")
    text = table(device, rows)
    files.write_atomically(os.path.join(out_dir, "accelerator_check.md"), text)
    log(text)
    return rows
