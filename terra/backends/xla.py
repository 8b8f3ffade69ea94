"""The XLA forms of the decode primitives: what runs on every platform, and wherever no native
form applies (training, prefill, more rows than a kernel takes, the kernels not built).

XLA:CPU turns ``w.astype(float32) @ x`` into a conversion of the whole matrix to a float32 buffer
in memory followed by the product: the narrow weights are read once and a 4-byte copy written and
read again, many times slower than the float32 product (``docs/design/cpu_decoding.md``). Converting
block by block inside a loop keeps each widened block in cache, so memory traffic is the narrow
bytes alone; that still runs well below the bandwidth, which is why the CPU backend
(``terra/backends/cpu.py``) replaces these forms in decoding.
"""

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from terra.backends.decode_state import KVCache
from terra.quantization.quantized import QuantizedTensor, widen

# Widened float32 elements per block: 4 MiB, about the size of a core's L2 plus part of the L3
# slice, where the measured time stops improving (docs/design/cpu_decoding.md).
BLOCK_ELEMENTS = 1 << 20
# Widened float32 elements per block of cache positions (8 MiB; 2048 positions of 16 heads x 64):
# the fastest size measured for an int8 cache step, where smaller blocks add loop iterations and
# widening whole writes a float32 copy in memory (docs/architecture.md, "Narrow caches").
CACHE_BLOCK_ELEMENTS = 1 << 21
# Rows of x from which a narrow kernel is widened whole, in one product (a prefill, training): the
# product's arithmetic is then many times the widening's, and the blocks' loop only added a zeroed
# float32 output per product, which XLA allocates before the loop (in a prefill every layer's at once).
WIDEN_WHOLE_ROWS = 64
# Additive mask value for disallowed positions (the reference uses -1e9).
MASK_VALUE = -1e9


def dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in]`` times a 2-D output-major ``kernel [out, in]`` -> ``[..., out]``, read in
    place: XLA:CPU reads this layout faster than ``[in, out]`` and no transpose is ever
    materialised (``terra/layers/dense.py``)."""
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))


def widened_output_major(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x [..., in]`` times narrow ``values [out, *in_axes]`` (``scale`` per row, or per row and
    run of ``in_axes[-1]`` inputs; a scalar for bfloat16), widened block by block of
    ``BLOCK_ELEMENTS``, the last block possibly shorter.

    The blocks are dynamic slices of ``values`` in a ``fori_loop``: a ``lax.map`` over
    ``values[:head].reshape(blocks, ...)`` (``head`` short of ``out`` when a shorter last block
    remains) copies the matrix and is several times slower on XLA:CPU (docs/design/cpu_decoding.md)."""
    n_out = values.shape[0]
    per_row = kind == "int8"  # bfloat16 has one unused scale, passed whole to every block

    def product(start, size):
        v = lax.dynamic_slice_in_dim(values, start, size)
        s = lax.dynamic_slice_in_dim(scale, start, size) if per_row else scale
        return dot(x, widen(v, s, kind).reshape(size, -1))

    def place(y, start, part):  # each block is its own slice of the output
        return lax.dynamic_update_slice_in_dim(y, part, start, axis=-1)

    return _over_blocks(n_out, x.shape[-1], product, place, x.shape[:-1] + (n_out,), _block_elements(x, values))


def widened_input_major(x: jax.Array, values: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """``x [..., in]`` times narrow input-major ``values [in, out]`` (int8 ``scale [in, groups]``).

    A kernel with one scale per input row has its scales folded into ``x`` (``sum_i x_i s_i v_i =
    sum_i (x_i s_i) v_i``) and only the values widened, block by block of ``BLOCK_ELEMENTS`` input
    rows, the partial products summed; finer scales (several output axes) are widened whole."""
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

    out_shape = x.shape[:-1] + (values.shape[1],)
    return _over_blocks(values.shape[0], values.shape[1], product, accumulate, out_shape, _block_elements(x, values))


def _block_elements(x: jax.Array, values: jax.Array) -> Optional[int]:
    """Widened elements per block of a product of ``x``: the whole kernel for
    ``WIDEN_WHOLE_ROWS`` rows of ``x`` or more, else ``BLOCK_ELEMENTS`` (``None``)."""
    return values.size if math.prod(x.shape[:-1]) >= WIDEN_WHOLE_ROWS else None


def _over_blocks(n_rows: int, row_elements: int, product, add, out_shape, block_elements=None):
    """``product(start, size)`` over blocks of ``BLOCK_ELEMENTS // row_elements`` weight rows, in
    a ``fori_loop`` of dynamic slices (slicing ``values[:head]`` up front copies the matrix), and a
    shorter last block; ``add(y, start, part)`` folds each block's product into the float32
    ``y`` of ``out_shape``. ``block_elements``: the widened elements per block (default
    ``BLOCK_ELEMENTS``)."""
    block = max(1, min(n_rows, (block_elements or BLOCK_ELEMENTS) // row_elements))
    n_blocks, tail = divmod(n_rows, block)
    if n_blocks == 1 and not tail:
        return product(0, n_rows)
    y = jnp.zeros(out_shape, jnp.float32)
    y = lax.fori_loop(0, n_blocks, lambda k, y: add(y, k * block, product(k * block, block)), y)
    head = n_blocks * block
    return add(y, head, product(head, tail)) if tail else y


def read_rows(matrix, select) -> jax.Array:
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
    ('fill') makes XLA:CPU's gather slower (docs/design/cpu_decoding.md)."""
    return read_rows(matrix, lambda a: jnp.take(a, rows, axis=0, mode="clip"))


def gathered_rows_product(x: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[..., j] = matrix[rows[..., j]] . x[...]`` with the rows gathered (and widened) first."""
    return jnp.einsum("...d,...kd->...k", x, take_rows(matrix, rows))


def gathered_rows_sum(h: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[...] = sum_j h[..., j] matrix[rows[..., j]]`` with the rows gathered (and widened) first."""
    return jnp.einsum("...k,...kd->...d", h, take_rows(matrix, rows))


def cache_logits(q: jax.Array, keys: jax.Array, key_scale: Optional[jax.Array] = None) -> jax.Array:
    """``q [b, h, lq, d]`` (float) times a cache's ``keys [b, h, L, d]`` -> float32 logits
    ``[b, h, lq, L]``.

    Keys of ``q``'s dtype: one product, as before narrow caches. Narrow keys (int8 with
    ``key_scale [b, h, L]``, or bfloat16 bits in ``uint16``): ``q . (s_k K_k) = s_k (q . K_k)``,
    so the product runs on the widened values block by block of positions and the scale multiplies
    the logits; XLA:CPU would otherwise write a float32 copy of the whole cache before the product
    (``convert`` is not fused into a dot), reading 1 byte and writing 4 per element every step."""
    if key_scale is None and keys.dtype == q.dtype:
        return jnp.einsum("bhqd,bhkd->bhqk", q, keys).astype(jnp.float32)

    def product(start, size):
        block = _widened_positions(keys, start, size)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), block)
        if key_scale is not None:
            logits = logits * lax.dynamic_slice_in_dim(key_scale, start, size, axis=2)[:, :, None, :]
        return logits

    def place(y, start, part):
        return lax.dynamic_update_slice_in_dim(y, part, start, axis=-1)

    out_shape = q.shape[:-1] + (keys.shape[2],)
    return _over_positions(keys, product, place, out_shape)


def cache_weighted_values(probs: jax.Array, values: jax.Array, value_scale: Optional[jax.Array] = None) -> jax.Array:
    """``probs [b, h, lq, L]`` times a cache's ``values [b, h, L, d]`` -> ``[b, h, lq, d]``.

    Values of ``probs``' dtype: one product. Narrow values: ``sum_k p_k s_k V_k = (p * s) . V``,
    the scale folded into the probabilities and the values widened block by block of positions
    (float32 result), as :func:`cache_logits`."""
    if value_scale is None and values.dtype == probs.dtype:
        return jnp.einsum("bhqk,bhkd->bhqd", probs, values)
    probs = probs.astype(jnp.float32)
    if value_scale is not None:
        probs = probs * value_scale[:, :, None, :]

    def product(start, size):
        block = _widened_positions(values, start, size)
        return jnp.einsum("bhqk,bhkd->bhqd", lax.dynamic_slice_in_dim(probs, start, size, axis=3), block)

    def accumulate(y, start, part):
        return y + part

    return _over_positions(values, product, accumulate, probs.shape[:-1] + (values.shape[-1],))


def _widened_positions(cache: jax.Array, start, size: int) -> jax.Array:
    """Positions ``[start, start + size)`` of a narrow cache ``[b, h, L, d]`` as float32 (int8
    unscaled). A bfloat16 cache is stored as its ``uint16`` bits (``terra/backends/decode_state.py``),
    widened shifted into a float32's high half in the slice's fused loop."""
    block = lax.dynamic_slice_in_dim(cache, start, size, axis=2)
    if block.dtype == jnp.uint16:
        return lax.bitcast_convert_type(block.astype(jnp.uint32) << 16, jnp.float32)
    return block.astype(jnp.float32)


def _over_positions(cache: jax.Array, product, add, out_shape):
    """:func:`_over_blocks` over the positions (axis 2) of a cache ``[b, h, L, d]``, in blocks of
    ``CACHE_BLOCK_ELEMENTS`` widened elements."""
    b, h, length, d = cache.shape
    return _over_blocks(length, b * h * d, product, add, out_shape, CACHE_BLOCK_ELEMENTS)


def cache_attention(q, keys, values, bias, key_scale=None, value_scale=None, visible=None, own=None, dropout=None):
    """One decode step's attention of one query per head over a whole cache: ``q [b, h, 1, d]``
    (float, scaled by ``d ** -0.5``), the cache's ``keys``/``values [b, h, L, d]`` as it stores them
    (``terra/backends/decode_state.py``: float, int8 with ``key_scale``/``value_scale [b, h, L]``, or
    bfloat16 bits), ``bias [b, L]`` added to the logits (``MASK_VALUE`` hides a position), and for
    self-attention ``own = (k, v)`` ``[b, h, 1, d]``, the query's own key and value, attended to
    beside the cache. ``visible`` (int32 ``[]``) promises that the bias hides every position from
    ``visible`` on, so that a native form need not read them; this form reads the whole cache.
    ``dropout``: applied to the probabilities. Returns ``y [b, h, 1, d]`` in ``q``'s dtype."""
    del visible
    logits = cache_logits(q, keys, key_scale) + bias[:, None, None, :].astype(jnp.float32)
    length = keys.shape[2]
    if own is not None:
        k, v = own
        own_logits = jnp.sum(q * k, axis=-1, keepdims=True).astype(jnp.float32)
        logits = jnp.concatenate([logits, own_logits], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    if dropout is not None:
        probs = dropout(probs)
    probs = probs.astype(q.dtype)
    y = cache_weighted_values(probs[..., :length], values, value_scale).astype(q.dtype)
    if own is not None:
        y = y + probs[..., length:] * own[1]
    return y


def cached_attention(q, k, v, cache: KVCache, dropout=None, attend=cache_attention) -> Tuple[jax.Array, KVCache]:
    """One decode step of causal attention over a self-attention's :class:`KVCache`: q, k, v
    ``[b, h, 1, d]`` (the new position), the cache's positions ``< cache.index`` written (and,
    where a prefill padded some, ``cache.key_mask`` true for real ones). Returns ``(y [b, h, 1, d],
    the cache with k and v written narrow at its index)``. The new position attends to its own k
    and v exactly; a narrow cache (``terra/backends/decode_state.py``) is read narrow.

    ``attend``: the attention's read, :func:`cache_attention`'s signature (this form, or a
    backend's that reads only the visible positions). It attends over the cache as it was plus the
    new token, then the new key and value are written in place after the read
    (:meth:`KVCache.written`)."""
    max_len = cache.max_length
    scale = jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    visible = jnp.arange(max_len)[None, :] < cache.index
    if cache.key_mask is not None:
        visible = visible & cache.key_mask
    bias = jnp.broadcast_to(jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32), (q.shape[0], max_len))
    y = attend(
        q * scale, cache.key, cache.value, bias, cache.key_scale, cache.value_scale, cache.index, (k, v), dropout
    )
    return y, cache.written(k, v, after=y)


def attention_in_query_chunks(q, k, v, bias, *, causal: bool, chunk: int) -> jax.Array:
    """Softmax attention computed ``chunk`` queries at a time, equal to the whole computation:
    q ``[b, h, lq, d]``, k/v ``[b, h, lk, d]``, ``bias`` ``[b|1, 1, 1, lk]`` (the same for every
    query), ``causal`` for a self-attention (lq == lk) -> ``[b, h, lq, d]``. Peak memory holds
    one chunk's scores, ``[b, h, chunk, lk]``, as long-context inference engines prefill."""
    batch, heads, length, d = q.shape
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    q = q * jnp.asarray(d**-0.5, q.dtype)
    chunks = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(batch, heads, n_chunks, chunk, d)
    key_positions = jnp.arange(k.shape[2])
    bias = jnp.broadcast_to(bias, (bias.shape[0], 1, 1, k.shape[2])).astype(jnp.float32)

    def one_chunk(args):
        index, q_chunk = args
        logits = jnp.einsum("bhqd,bhkd->bhqk", q_chunk, k).astype(jnp.float32) + bias
        if causal:
            query_positions = index * chunk + jnp.arange(chunk)
            logits = logits + jnp.where(key_positions[None, :] <= query_positions[:, None], 0.0, MASK_VALUE)
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v)

    y = lax.map(one_chunk, (jnp.arange(n_chunks), jnp.moveaxis(chunks, 2, 0)))  # [n, b, h, chunk, d]
    return jnp.moveaxis(y, 0, 2).reshape(batch, heads, n_chunks * chunk, d)[:, :, :length]
