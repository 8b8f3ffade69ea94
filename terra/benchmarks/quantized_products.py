"""Narrow-weight matrix-vector products against float32 on this CPU: the decode step's products
``x [rows, in] x W [out, in]^T`` with W stored float32, int8 or bfloat16, read by XLA (the
block-widening product of ``terra/backends/xla.py``) or by the native kernel
(``terra/backends/native_kernels.py``; float32 weights for a batch of a few rows), beside the
machine's read bandwidth measured in the same run.

Batch-1 decoding reads every weight once per token, from DRAM: a weight is never in cache when
the step comes back to it. So each timed call runs one product on each of enough copies of the
weights to overflow the last-level cache several times over, and the time per product is the call
divided by the copies. The shapes marked hot are timed in cache instead, :data:`LOOP_CALLS`
products of the same weights in one jitted loop: the tiny one gives the per-call overhead of a path,
the in-cache one its arithmetic rate, the most bytes per second it could stream were memory
infinitely fast (for int8 and bfloat16, the widening and multiply-adds of every weight; every way
of keeping the activations float32 takes one multiply instruction per 16 weights, whatever their
width: docs/decode_speed.md#quantized-decoding). Each product depends on the previous one (a
scalar of its output is added to the next input), so none overlaps another.

Run: ``terra-bench products [--rows 1] [--repeats 15]``.
"""

import math
import time
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from terra import backends
from terra.backends import native_kernels
from terra.benchmarks.bandwidth import describe_machine, measure_read_bandwidth
from terra.quantization import quantize_compiled

# (name, in, out, hot): the products of a decode step at the paper's widths, streamed from memory,
# and two timed in cache (hot).
SHAPES = (
    ("24 layers' FF weights", 1024, 98304, False),
    ("one FF weight", 1024, 4096, False),
    ("logits (32k vocab)", 1024, 32000, False),
    ("d_model 9216, square", 9216, 9216, False),
    ("in cache: arithmetic rate", 1024, 1024, True),
    ("tiny: per-call overhead", 64, 64, True),
)
# (name, stored dtype, native kernel): every path a decode step can take. "float32" is XLA's
# product, every path's baseline; "kernel float32" runs where it applies (a batch of a few rows).
VARIANTS = (
    ("float32", "float32", False),
    ("XLA int8", "int8", False),
    ("XLA bfloat16", "bfloat16", False),
    ("kernel int8", "int8", True),
    ("kernel bfloat16", "bfloat16", True),
    ("kernel float32", "float32", True),
)


def timed_variants(rows: int, n_in: int, variants=VARIANTS) -> list:
    """The paths a product of ``rows`` rows of ``n_in`` inputs can take here: the kernels' where they
    are built, the float32 kernel where it takes that product (``native_kernels.float_kernel_applies``)."""
    if not native_kernels.available():
        return [v for v in variants if not v[2]]
    float_kernel = native_kernels.float_kernel_applies(rows, n_in)
    return [
        (name, dtype, native) for name, dtype, native in variants if float_kernel or not (native and dtype == "float32")
    ]


# Bytes of weight copies per timed call: 6x the 32 MiB L3 of the machine this was written on, so
# a copy is evicted long before the next call reads it again.
EVICT_BYTES = 192 << 20
MAX_COPIES = 64
LOOP_CALLS = 1000


def stored_bytes(weights) -> int:
    """Bytes a product streams: the values and (int8) the scales."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(weights))


def _store(w: jax.Array, dtype: str):
    return w if dtype == "float32" else quantize_compiled(w, dtype)


def _chain(x: jax.Array, weights: Sequence) -> jax.Array:
    """One product per weight, each on an input that depends on the previous output."""
    y = x
    for w in weights:
        y = backends.output_major_product(x, w)
        x = x + 1e-30 * y[..., :1]
    return y


def _loop(x: jax.Array, w) -> jax.Array:
    def body(_, x):
        return x + 1e-30 * backends.output_major_product(x, w)[..., :1]

    return jax.lax.fori_loop(0, LOOP_CALLS, body, x)


def time_product(x: jax.Array, weights, native: bool, repeats: int, hot: bool = False) -> float:
    """Median seconds of one product ``x`` times ``weights`` (float32 or a QuantizedTensor) by
    the native kernel or XLA, streamed from memory, or (``hot``) the same weights over and over
    from cache."""
    if native and not native_kernels.available():
        raise RuntimeError("the native kernels are not available")
    # A new function object per call: jit's cache must not hand one path's compilation to the other.
    if hot:
        copies, fn = 1, jax.jit(lambda x, w: _loop(x, w))
        args = (x, weights)
    else:
        copies = min(MAX_COPIES, max(1, math.ceil(EVICT_BYTES / stored_bytes(weights))))
        stack = [weights] + [jax.tree.map(jnp.copy, weights) for _ in range(copies - 1)]
        fn = jax.jit(lambda x, ws: _chain(x, ws))
        args = (x, stack)
    calls = LOOP_CALLS if hot else copies
    # The path is chosen when the product is traced: the first call traces and compiles.
    if native:
        jax.block_until_ready(fn(*args))
    else:
        with native_kernels.disabled():
            jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def measure(rows: int = 1, repeats: int = 15, shapes=SHAPES, variants=VARIANTS, bandwidth: Optional[float] = None):
    """One dict per (shape, variant): seconds, bytes, GB/s, speed-up over float32 and the time over
    the byte floor (bytes / ``bandwidth``, measured here when not given)."""
    if bandwidth is None:
        bandwidth = measure_read_bandwidth()
    results = []
    for shape_name, n_in, n_out, hot in shapes:
        w = jax.random.normal(jax.random.key(0), (n_out, n_in), jnp.float32)
        x = jax.random.normal(jax.random.key(1), (rows, n_in), jnp.float32)
        base = None
        for name, dtype, native in timed_variants(rows, n_in, variants):
            weights = _store(w, dtype)
            seconds = time_product(x, weights, native, repeats, hot)
            size = stored_bytes(weights)
            base = seconds if dtype == "float32" and not native else base
            results.append(
                {
                    "shape": f"[{rows},{n_in}]x[{n_out},{n_in}]",
                    "shape_name": shape_name,
                    "variant": name,
                    "seconds": seconds,
                    "bytes": size,
                    "gb_per_s": size / seconds / 1e9,
                    "speedup": base / seconds if base else None,
                    # In cache, memory sets no floor.
                    "over_floor": None if hot else seconds / (size / bandwidth),
                }
            )
            del weights
        del w
    return results, bandwidth


def format_table(results: List[dict], bandwidth: float) -> str:
    lines = [
        f"read bandwidth (terra.benchmarks.bandwidth): {bandwidth / 1e9:.1f} GB/s",
        "",
        f"| {'product':<26} | {'shape':<24} | {'path':<15} | {'time':>10} | {'GB/s':>6} | {'x float32':>9} | "
        f"{'x floor':>7} |",
        f"|{'-' * 28}|{'-' * 26}|{'-' * 17}|{'-' * 12}|{'-' * 8}|{'-' * 11}|{'-' * 9}|",
    ]
    for r in results:
        shown = f"{r['seconds'] * 1e3:.3f} ms" if r["seconds"] >= 1e-4 else f"{r['seconds'] * 1e6:.2f} us"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        over_floor = f"{r['over_floor']:.2f}" if r["over_floor"] else "-"
        lines.append(
            f"| {r['shape_name']:<26} | {r['shape']:<24} | {r['variant']:<15} | {shown:>10} | "
            f"{r['gb_per_s']:>6.1f} | {speedup:>9} | {over_floor:>7} |"
        )
    return "\n".join(lines)


def run(rows: int = 1, repeats: int = 15, print_fn: Callable[[str], None] = print) -> List[dict]:
    """Measures every shape (``rows`` rows of x, the median of ``repeats`` calls) and prints the table."""
    machine = describe_machine()
    print_fn(f"{machine['cpu']}, {machine['usable_cores']} cores, jax {machine['jax']}, {machine['backend']}")
    if native_kernels.available():
        print_fn(f"native kernels: {native_kernels.isa()}")
    else:
        print_fn("native kernels: not available (kernel rows skipped)")
    results, bandwidth = measure(rows, repeats)
    print_fn(format_table(results, bandwidth))
    return results
