"""Products that read narrow weights (:class:`~terra.quantization.QuantizedTensor`) at the speed of
their bytes, inside a jitted decode step.

XLA:CPU turns ``w.astype(float32) @ x`` into a conversion of the whole matrix to a float32 buffer
in memory followed by the product: the narrow weights are read once and a 4-byte copy written and
read again, 10× slower than the float32 product (``docs/design/cpu_decoding.md``). Converting
block by block inside a ``lax.map`` keeps each widened block in cache, so memory traffic is the
narrow bytes alone.
"""

import jax
import jax.numpy as jnp
from jax import lax

from terra.quantization.quantized import QuantizedTensor, widen

# Widened float32 elements per block: 4 MiB, about the size of a core's L2 plus part of the L3
# slice, where the measured time stops improving (docs/design/cpu_decoding.md).
BLOCK_ELEMENTS = 1 << 20


def _rows(q: QuantizedTensor, n_rows: int):
    """``values [n_rows, *in]`` and ``scale [n_rows, *in[:-1]]`` (a scalar for bfloat16), where
    the leading axes of ``q`` that multiply to ``n_rows`` are merged."""
    size, k = 1, 0
    while size < n_rows and k < q.values.ndim:
        size, k = size * q.values.shape[k], k + 1
    if size != n_rows:
        raise ValueError(f"no leading axes of {q.values.shape} make {n_rows} rows")
    in_shape = q.values.shape[k:]
    values = q.values.reshape((n_rows,) + in_shape)
    scale = q.scale if q.kind == "bfloat16" else q.scale.reshape((n_rows,) + in_shape[:-1])
    return values, scale


def _widened_rows(values, scale, kind) -> jax.Array:
    """``[rows, *in]`` stored -> ``[rows, prod(in)]`` float32."""
    wide = widen(values, scale, kind)
    return wide.reshape(wide.shape[0], -1)


def output_major_product(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in]`` times ``kernel [out, *in_axes]`` (``prod(in_axes) == in``), float32 or a
    :class:`QuantizedTensor` with ``out`` rows -> ``[..., out]``. A float32 kernel must already be
    2-D ``[out, in]``."""
    if not isinstance(kernel, QuantizedTensor):
        return lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
    n_in = x.shape[-1]
    n_out = kernel.values.size // n_in
    values, scale = _rows(kernel, n_out)
    block = max(1, min(n_out, BLOCK_ELEMENTS // n_in))
    n_blocks, tail = divmod(n_out, block)

    def product(v, s):
        w = _widened_rows(v, s, kernel.kind)
        return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))

    if n_blocks <= 1 and not tail:
        return product(values, scale)
    parts = []
    if n_blocks:
        head_v = values[: n_blocks * block].reshape((n_blocks, block) + values.shape[1:])
        if kernel.kind == "bfloat16":
            ys = lax.map(lambda v: product(v, scale), head_v)
        else:
            head_s = scale[: n_blocks * block].reshape((n_blocks, block) + scale.shape[1:])
            ys = lax.map(lambda vs: product(*vs), (head_v, head_s))
        # [n_blocks, ..., block] -> [..., n_blocks * block]
        parts.append(jnp.moveaxis(ys, 0, -2).reshape(x.shape[:-1] + (n_blocks * block,)))
    if tail:
        tail_s = scale if kernel.kind == "bfloat16" else scale[n_blocks * block :]
        parts.append(product(values[n_blocks * block :], tail_s))
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def take_rows(matrix, rows: jax.Array) -> jax.Array:
    """``matrix[rows]`` along axis 0 as float32, for a float32 array or a :class:`QuantizedTensor`
    (the gathered rows are widened with their own scales: a few rows, in cache).
    ``mode='clip'``: the rows are in range by construction, and the default bounds handling
    ('fill') makes XLA:CPU's gather about twice as slow."""
    if not isinstance(matrix, QuantizedTensor):
        return jnp.take(matrix, rows, axis=0, mode="clip")
    values = jnp.take(matrix.values, rows, axis=0, mode="clip")
    scale = matrix.scale if matrix.kind == "bfloat16" else jnp.take(matrix.scale, rows, axis=0, mode="clip")
    return widen(values, scale, matrix.kind)
