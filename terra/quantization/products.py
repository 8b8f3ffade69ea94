"""Products that read narrow weights (:class:`~terra.quantization.QuantizedTensor`) at the speed of
their bytes, inside a jitted decode step.

XLA:CPU turns ``w.astype(float32) @ x`` into a conversion of the whole matrix to a float32 buffer
in memory followed by the product: the narrow weights are read once and a 4-byte copy written and
read again, 10× slower than the float32 product (``docs/design/cpu_decoding.md``). Converting
block by block inside a loop keeps each widened block in cache, so memory traffic is the narrow
bytes alone; that still runs at about half the bandwidth. Decoding's products (a few rows
of float32 activations, on the CPU) therefore go to the native kernels of
``terra/quantization/kernels.py``, which widen 16 weights at a time in registers: the dense
output-major product streams int8 weights about twice as fast as the blocked product
(``terra-bench products``), and the sparse layers' products (the input-major multiplicative,
convolution and controller kernels; the rows of W1 and W2 a sparse feed-forward layer selects) read
their narrow weights in place, with no float32 copy of a kernel or of the gathered rows.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from terra.quantization import kernels
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
    read by the native kernel (``terra/quantization/kernels.py``) on the CPU when ``x`` is float32
    with at most ``kernels.MAX_ROWS`` rows (decoding), else widened block by block."""
    if not isinstance(kernel, QuantizedTensor):
        return _dot(x, kernel)
    n_in = x.shape[-1]
    n_out = kernel.values.size // n_in
    values, scale = _rows(kernel, n_out)
    rows = math.prod(x.shape[:-1])

    def native(x, values, scale):
        # int8: one scale per output row, or per row and group of in_axes[-1] consecutive inputs.
        groups = scale.reshape(n_out, -1) if kernel.kind == "int8" else scale
        y = kernels.output_major(x.reshape(rows, n_in), values.reshape(n_out, n_in), groups, kernel.kind)
        return y.reshape(x.shape[:-1] + (n_out,))

    def widened(x, values, scale):
        return _widened_product(x, values, scale, kernel.kind)

    use_native = n_out > 0 and native_applies(x, rows, kernels.MAX_ROWS)
    return _native_or_xla(use_native, native, widened, x, values, scale)


def native_applies(x: jax.Array, rows: int, max_rows: int) -> bool:
    """Whether a product of ``x`` (``rows`` rows of activations) may use a native kernel: float32
    activations, 1 to ``max_rows`` rows (decoding), and the kernels built and switched on."""
    return x.dtype == jnp.float32 and 0 < rows <= max_rows and kernels.available()


def fused_applies(x: jax.Array, rows: int, max_rows: int) -> bool:
    """Whether a sparse layer's decode step may run as one fused native call: as
    :func:`native_applies`, with the fused kernels not turned off (``kernels.unfused``)."""
    return native_applies(x, rows, max_rows) and kernels.fused_available()


def _native_or_xla(use_native: bool, native, xla, *operands) -> jax.Array:
    """``native(*operands)`` where the computation is lowered for the CPU and ``use_native``, else
    ``xla(*operands)``: the kernels are registered for the CPU only, and only the branch of the
    platform lowered is compiled."""
    if not use_native:
        return xla(*operands)
    return lax.platform_dependent(*operands, cpu=native, default=xla)


def _widened_product(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x [..., in]`` times ``values [out, *in_axes]`` (``scale`` as :func:`_rows` gives it),
    widened block by block of ``BLOCK_ELEMENTS``, the last block possibly shorter.

    The blocks are dynamic slices of ``values`` in a ``fori_loop``: a ``lax.map`` over
    ``values[:head].reshape(blocks, ...)`` (``head`` short of ``out`` when a shorter last block
    remains) measured 5x slower on XLA:CPU ([32000, 1024] int8: 14.9 ms against 2.4 ms)."""
    n_out = values.shape[0]
    per_row = kind == "int8"  # bfloat16 has one unused scale, passed whole to every block

    def product(start, size):
        v = lax.dynamic_slice_in_dim(values, start, size)
        s = lax.dynamic_slice_in_dim(scale, start, size) if per_row else scale
        return _dot(x, widen(v, s, kind).reshape(size, -1))

    def place(y, start, part):  # each block is its own slice of the output
        return lax.dynamic_update_slice_in_dim(y, part, start, axis=-1)

    return _over_blocks(n_out, x.shape[-1], product, place, x.shape[:-1] + (n_out,))


def _over_blocks(n_rows: int, row_elements: int, product, add, out_shape):
    """``product(start, size)`` over blocks of ``BLOCK_ELEMENTS // row_elements`` weight rows, in
    a ``fori_loop`` of dynamic slices (slicing ``values[:head]`` up front copies the matrix), and a
    shorter last block; ``add(y, start, part)`` folds each block's product into the float32
    ``y`` of ``out_shape``."""
    block = max(1, min(n_rows, BLOCK_ELEMENTS // row_elements))
    n_blocks, tail = divmod(n_rows, block)
    if n_blocks == 1 and not tail:
        return product(0, n_rows)
    y = jnp.zeros(out_shape, jnp.float32)
    y = lax.fori_loop(0, n_blocks, lambda k, y: add(y, k * block, product(k * block, block)), y)
    head = n_blocks * block
    return add(y, head, product(head, tail)) if tail else y


def _read_rows(matrix, select) -> jax.Array:
    """``select(matrix)`` (a selection along axis 0) as float32: of a float32 array, or of a
    :class:`QuantizedTensor`'s values and their row scales, then only those rows widened."""
    if not isinstance(matrix, QuantizedTensor):
        return select(matrix)
    scale = matrix.scale if matrix.kind == "bfloat16" else select(matrix.scale)
    return widen(select(matrix.values), scale, matrix.kind)


def take_rows(matrix, rows: jax.Array) -> jax.Array:
    """``matrix[rows]`` along axis 0 as float32, for a float32 array or a :class:`QuantizedTensor`
    (the gathered rows are widened with their own scales: a few rows, in cache).
    ``mode='clip'``: the rows are in range by construction, and the default bounds handling
    ('fill') makes XLA:CPU's gather about twice as slow."""
    return _read_rows(matrix, lambda a: jnp.take(a, rows, axis=0, mode="clip"))


def input_major_product(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in]`` times an input-major ``kernel [in, *out_axes]`` -> ``[..., prod(out_axes)]``:
    the layout of the small multiplicative and convolution kernels (``terra/layers/multiplicative.py``)
    and of the sparse feed-forward controller's up-projection, where a :class:`QuantizedTensor` has
    one scale per input row and run of ``out_axes[-1]`` outputs.

    On the CPU, with float32 ``x`` of at most ``kernels.MAX_INPUT_MAJOR_ROWS`` rows (decoding), the
    native kernel reads the narrow weights in place. Otherwise a kernel with one scale per input
    row has its scales folded into ``x`` (``sum_i x_i s_i v_i = sum_i (x_i s_i) v_i``) and only
    the values widened, block by block of ``BLOCK_ELEMENTS`` input rows, the partial products
    summed; finer scales (several output axes) are widened whole. A kernel stored transposed,
    ``[*out_axes, in]`` (the decode tree's controller), is read by :func:`output_major_product`."""
    if not isinstance(kernel, QuantizedTensor):
        return x @ jnp.asarray(kernel, x.dtype).reshape(kernel.shape[0], -1)
    if kernel.transposed:
        return _transposed_product(x, kernel.output_major())
    n_in = kernel.values.shape[0]
    values = kernel.values.reshape(n_in, -1)
    scale = kernel.scale if kernel.kind == "bfloat16" else kernel.scale.reshape(n_in, -1)
    rows = math.prod(x.shape[:-1])

    def native(x, values, scale):
        y = kernels.input_major(x.reshape(rows, n_in), values, scale, kernel.kind)
        return y.reshape(x.shape[:-1] + (values.shape[1],))

    def widened(x, values, scale):
        return _widened_input_major(x, values, scale, kernel.kind)

    use_native = native_applies(x, rows, kernels.MAX_INPUT_MAJOR_ROWS)
    return _native_or_xla(use_native, native, widened, x, values, scale)


def _transposed_product(x: jax.Array, kernel: QuantizedTensor) -> jax.Array:
    """``x [..., in]`` times an input-major kernel stored transposed (``kernel``: its output-major
    form). More rows than the output-major kernel takes (a beam search's sparse loss: beams x S
    modules) go to it in chunks of ``kernels.MAX_ROWS``, each chunk reading the weights again:
    with the sparse loss's ``[1024, 8000]`` kernel in int8 that is faster than the input-major
    kernel at 16 rows and within 1.2x of it at 32, where XLA's blocked product is 1.3-1.5x slower."""
    rows = math.prod(x.shape[:-1])
    if rows <= kernels.MAX_ROWS or not native_applies(x, rows, kernels.MAX_INPUT_MAJOR_ROWS):
        return output_major_product(x, kernel)
    flat = x.reshape(rows, x.shape[-1])
    chunks = [output_major_product(flat[i : i + kernels.MAX_ROWS], kernel) for i in range(0, rows, kernels.MAX_ROWS)]
    return jnp.concatenate(chunks).reshape(x.shape[:-1] + (-1,))


def _widened_input_major(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x [..., in]`` times ``values [in, out]`` with ``scale`` as ``input_major_product`` reshapes
    it (``[in, groups]`` for int8), in XLA."""
    if kind == "int8" and scale.shape[1] > 1:
        return x @ widen(values.reshape(scale.shape + (-1,)), scale, kind).reshape(values.shape)
    if kind == "int8":
        x = x * scale[:, 0]
    unscaled = jnp.ones((), jnp.float32)  # int8's scales are in x; bfloat16 has none

    def product(start, size):
        x_block = lax.dynamic_slice_in_dim(x, start, size, axis=-1)
        return x_block @ widen(lax.dynamic_slice_in_dim(values, start, size), unscaled, kind)

    def accumulate(y, start, part):  # each block of input rows adds its partial product
        return y + part

    return _over_blocks(values.shape[0], values.shape[1], product, accumulate, x.shape[:-1] + (values.shape[1],))


def _gathered(kernel, x: jax.Array, matrix, rows: jax.Array, out_width: int, xla) -> jax.Array:
    """``kernel`` (``kernels.gathered_dot`` or ``gathered_sum``) of ``x [..., *]``, ``matrix`` and
    ``rows [..., k]`` -> ``[..., out_width]`` for a narrow ``matrix`` in decoding (at most
    ``kernels.MAX_ROWS`` rows), else ``xla(x, matrix, rows)``."""
    batch = math.prod(rows.shape[:-1])
    if not (isinstance(matrix, QuantizedTensor) and rows.shape[-1] > 0):
        return xla(x, matrix, rows)

    def native(x, values, scale, rows):
        y = kernel(x.reshape(batch, -1), values, scale, rows.reshape(batch, -1).astype(jnp.int32), matrix.kind)
        return y.reshape(rows.shape[:-1] + (out_width,))

    def widened(x, values, scale, rows):
        return xla(x, QuantizedTensor(values, scale, matrix.kind), rows)

    use_native = native_applies(x, batch, kernels.MAX_ROWS)
    return _native_or_xla(use_native, native, widened, x, matrix.values, matrix.scale, rows)


def gathered_rows_product(x: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[..., j] = matrix[rows[..., j]] . x[...]``: ``x [..., d]``, ``matrix [n, d]`` (float32 or
    a :class:`QuantizedTensor`), ``rows [..., k]`` -> ``[..., k]`` (the selected rows of a sparse
    feed-forward layer's W1). A narrow ``matrix`` in decoding is read by the native kernel, only
    the selected rows and in place; otherwise the rows are gathered (and widened) first."""

    def xla(x, matrix, rows):
        return jnp.einsum("...d,...kd->...k", x, take_rows(matrix, rows))

    return _gathered(kernels.gathered_dot, x, matrix, rows, rows.shape[-1], xla)


def gathered_rows_sum(h: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[...] = sum_j h[..., j] matrix[rows[..., j]]``: ``h [..., k]``, ``matrix [n, d]``,
    ``rows [..., k]`` -> ``[..., d]`` (the selected rows of W2), read as
    :func:`gathered_rows_product` reads them."""

    def xla(h, matrix, rows):
        return jnp.einsum("...k,...kd->...d", h, take_rows(matrix, rows))

    return _gathered(kernels.gathered_sum, h, matrix, rows, matrix.shape[-1], xla)


def slice_rows(matrix, start: jax.Array, length: int) -> jax.Array:
    """``matrix[start : start + length]`` along axis 0 as float32 (a dynamic start), for a float32
    array or a :class:`QuantizedTensor` (only the sliced rows widened)."""
    return _read_rows(matrix, lambda a: lax.dynamic_slice_in_dim(a, start, length, axis=0))
