"""The machine's sustained memory read bandwidth, measured with XLA itself.

A batch-1 decode step is bound by the bytes it must stream from DRAM, so its floor is
``bytes_per_token / bandwidth``. The bandwidth is the best of a full reduction (``max``) and a
matrix-vector product over a buffer far larger than the last-level cache; on a 2-core AMD
EPYC VM both match a vectorised C read loop on two threads.

Sparse layers move the limit: what they read shrinks far more than the arithmetic they do
(Sparse QKV's multiplicative layer and convolutions do nearly the dense Q, K, V products'
multiply-adds from 1/20 of their bytes), so the benchmark also measures the rate of the small
products a decode step runs (``measure_product_gflops``) and reports each step's arithmetic time.
"""

import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from terra import cpu_info


def measure_read_bandwidth(buffer_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """Sustained read bandwidth in bytes per second: the median over ``repeats`` passes of the
    faster kernel (a best single pass overstates it on a shared VM)."""
    n = buffer_bytes // 4
    cols = 4096
    rows = max(n // cols, 1)
    buffer = jnp.ones((rows, cols), jnp.float32)
    vector = jnp.ones((cols,), jnp.float32)
    kernels = (jax.jit(jnp.max), jax.jit(lambda m, v: m @ v))
    best = 0.0
    for kernel in kernels:
        args = (buffer,) if kernel is kernels[0] else (buffer, vector)
        jax.block_until_ready(kernel(*args))
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(kernel(*args))
            rates.append(buffer.nbytes / (time.perf_counter() - t0))
        best = max(best, float(np.median(rates)))
    del buffer
    return best


def measure_product_gflops(shape=(16, 1024, 64), repeats: int = 5, products: int = 2000) -> float:
    """Sustained GFLOP/s of small matrix products ``[m, k] x [k, n]``, by default the shape of a
    Sparse QKV decode product (S modules x d_model into M per module): at batch 1 these are the
    arithmetic a decode step cannot hide behind its memory reads. ``products`` run in one jitted
    loop, so no call overhead is counted; the median over ``repeats`` loops."""
    m, k, n = shape
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)

    @jax.jit
    def loop(a, b):
        # The operand changes every iteration so XLA cannot hoist the product out of the loop.
        def body(i, acc):
            return acc + (a + i.astype(jnp.float32)) @ b

        return jax.lax.fori_loop(0, products, body, jnp.zeros((m, n), jnp.float32))

    jax.block_until_ready(loop(a, b))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(a, b))
        rates.append(2.0 * m * k * n * products / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates))


# The vector extensions a decode step's products can use, as /proc/cpuinfo names them, in the
# order a reader compares CPUs by (the int8 dot-product and matrix instructions last).
VECTOR_EXTENSIONS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def vector_extensions(flags: str) -> str:
    """The :data:`VECTOR_EXTENSIONS` among a /proc/cpuinfo ``flags`` line's, joined by ``+``
    (``"avx2"``, ``"avx2+avx512f+avx512_vnni"``), or ``""`` where it names none of them."""
    present = set(flags.split())
    return "+".join(name for name in VECTOR_EXTENSIONS if name in present)


def _native_isa() -> str:
    """The instruction set terra's native kernels run with, or ``"off"``."""
    from terra.backends import native_kernels

    return native_kernels.isa() if native_kernels.available() else "off"


def describe_machine() -> dict:
    """CPU model, cores, vector extensions, the native kernels' instruction set and the XLA
    configuration the timings ran under."""
    fields = cpu_info.first_processor()
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags", "")
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": model,
        "isa": vector_extensions(flags),
        "native_kernels": _native_isa(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "xla_threads": usable,  # XLA:CPU sizes its intra-op thread pool to the usable cores
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "numpy": np.__version__,
    }
