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


def _dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in]`` times a 2-D output-major ``kernel [out, in]`` -> ``[..., out]``, read in
    place: XLA:CPU reads this layout faster than ``[in, out]`` and no transpose is ever
    materialised (``terra/layers/dense.py``)."""
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))


def output_major_product(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in]`` times ``kernel [out, *in_axes]`` (``prod(in_axes) == in``) -> ``[..., out]``:
    a float32 kernel (already 2-D ``[out, in]``) read in place, or a :class:`QuantizedTensor`
    widened block by block of ``BLOCK_ELEMENTS``, the last block possibly shorter."""
    if not isinstance(kernel, QuantizedTensor):
        return _dot(x, kernel)
    n_in = x.shape[-1]
    n_out = kernel.values.size // n_in
    values, scale = _rows(kernel, n_out)
    block = max(1, min(n_out, BLOCK_ELEMENTS // n_in))
    n_blocks, tail = divmod(n_out, block)
    per_row = kernel.kind == "int8"  # bfloat16 has one unused scale, passed whole to every block

    def product(v, s):
        return _dot(x, widen(v, s, kernel.kind).reshape(v.shape[0], -1))

    if n_blocks == 1 and not tail:
        return product(values, scale)
    head = n_blocks * block

    def split(a):
        return a[:head].reshape((n_blocks, block) + a.shape[1:])

    if per_row:
        ys = lax.map(lambda vs: product(*vs), (split(values), split(scale)))
    else:
        ys = lax.map(lambda v: product(v, scale), split(values))
    y = jnp.moveaxis(ys, 0, -2).reshape(x.shape[:-1] + (head,))  # [n_blocks, ..., block] -> [..., head]
    if not tail:
        return y
    return jnp.concatenate([y, product(values[head:], scale[head:] if per_row else scale)], axis=-1)


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
