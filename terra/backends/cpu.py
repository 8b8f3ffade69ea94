"""The CPU backend: the native forms of the decode primitives (``terra/backends/native_kernels.py``)
and when each applies.

Each function takes what a primitive knows at trace time (the activations, the stored weights)
and returns the native form, a function of the primitive's operands, or ``None`` where it does not
apply: activations that are not float32, more rows than a kernel takes (prefill, training), float32
weights outside a batch of a few rows, the kernels not built or switched off
(``native_kernels.disabled``, ``unfused``). The primitives (``terra/backends/primitives.py``) run
a native form only in the program lowered for the CPU; elsewhere the XLA form.

The native kernels widen 16 narrow weights at a time in registers: the dense output-major product
streams int8 weights faster than XLA's blocked product (``terra-bench products``;
docs/design/cpu_decoding.md), the sparse layers' products read their narrow weights in place, with
no float32 copy of a kernel or of the gathered rows, and a sparse layer's decode step is one call
(docs/architecture.md, decisions). Float32 weights take the output-major kernel for 2 to 16 rows
of activations (a batch decoding), which XLA:CPU's product reads several times over.
"""

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from terra.backends import native_kernels, xla
from terra.quantization.quantized import QuantizedTensor

PLATFORM = "cpu"
# Rows of x a fused sparse layer step takes in one call (the narrow kernels' MAX_ROWS).
FUSED_STEP_ROWS = native_kernels.MAX_ROWS


def native_applies(x: jax.Array, rows: int, max_rows: int) -> bool:
    """Whether a product of ``x`` (``rows`` rows of activations) may use a native kernel: float32
    activations, 1 to ``max_rows`` rows (decoding), and the kernels built and switched on."""
    return x.dtype == jnp.float32 and 0 < rows <= max_rows and native_kernels.available()


def fused_applies(x: jax.Array, rows: int, max_rows: int) -> bool:
    """Whether a sparse layer's decode step may run as one fused native call: as
    :func:`native_applies`, with the fused kernels not turned off (``native_kernels.unfused``)."""
    return native_applies(x, rows, max_rows) and native_kernels.fused_available()


def _one_narrow_kind(weights) -> Optional[str]:
    """The store shared by every weight of ``weights``, or ``None`` if one is float32 or they differ."""
    kinds = {w.kind if isinstance(w, QuantizedTensor) else None for w in weights}
    return None if len(kinds) != 1 or None in kinds else kinds.pop()


def output_major_product(x: jax.Array, kernel: QuantizedTensor, n_out: int):
    """``(x, values [out, in], scale) -> [..., out]``: the output-major kernel."""
    rows = math.prod(x.shape[:-1])
    if not (n_out > 0 and native_applies(x, rows, native_kernels.MAX_ROWS)):
        return None

    def native(x, values, scale):
        n_in = x.shape[-1]
        # int8: one scale per output row, or per row and group of in_axes[-1] consecutive inputs.
        groups = scale.reshape(n_out, -1) if kernel.kind == "int8" else scale
        y = native_kernels.output_major(x.reshape(rows, n_in), values.reshape(n_out, n_in), groups, kernel.kind)
        return y.reshape(x.shape[:-1] + (n_out,))

    return native


def float_output_major_product(x: jax.Array, kernel: jax.Array):
    """``(x, kernel [out, in]) -> [..., out]``: float32 weights, for a product of a few rows (a batch
    or beams decoding: ``native_kernels.float_kernel_applies``), which the kernel reads from memory
    once where XLA:CPU's product of a few rows reads them several times over."""
    rows = math.prod(x.shape[:-1])
    applies = kernel.dtype == jnp.float32 and native_kernels.float_kernel_applies(rows, x.shape[-1])
    if not (applies and native_applies(x, rows, native_kernels.MAX_FLOAT_ROWS)):
        return None

    def native(x, kernel):
        y = native_kernels.output_major(x.reshape(rows, kernel.shape[1]), kernel, None, "float32")
        return y.reshape(x.shape[:-1] + (kernel.shape[0],))

    return native


def input_major_product(x: jax.Array, kernel: QuantizedTensor):
    """``(x, values [in, out], scale [in, groups]) -> [..., out]``: the input-major kernel."""
    rows = math.prod(x.shape[:-1])
    if not native_applies(x, rows, native_kernels.MAX_INPUT_MAJOR_ROWS):
        return None

    def native(x, values, scale):
        y = native_kernels.input_major(x.reshape(rows, values.shape[0]), values, scale, kernel.kind)
        return y.reshape(x.shape[:-1] + (values.shape[1],))

    return native


def transposed_chunk_rows(x: jax.Array) -> Optional[int]:
    """Rows per output-major product for an input-major kernel stored transposed, where ``x`` has
    more rows than the output-major kernel takes (a beam search's sparse loss: beams x S modules):
    chunks of ``MAX_ROWS``, each reading the weights again. ``None``: one product (up to
    ``MAX_ROWS`` rows, whose passes of 8 read each chunk of weights from memory once)."""
    rows = math.prod(x.shape[:-1])
    if rows <= native_kernels.MAX_ROWS or not native_applies(x, rows, native_kernels.MAX_INPUT_MAJOR_ROWS):
        return None
    return native_kernels.MAX_ROWS


def _gathered(kernel, x: jax.Array, matrix: QuantizedTensor, rows: jax.Array, out_width: int):
    batch = math.prod(rows.shape[:-1])
    if not native_applies(x, batch, native_kernels.MAX_ROWS):
        return None

    def native(x, values, scale, rows):
        y = kernel(x.reshape(batch, -1), values, scale, rows.reshape(batch, -1).astype(jnp.int32), matrix.kind)
        return y.reshape(rows.shape[:-1] + (out_width,))

    return native


def gathered_rows_product(x: jax.Array, matrix: QuantizedTensor, rows: jax.Array):
    """``(x, values, scale, rows) -> [..., k]``: the dot with the selected rows, read in place."""
    return _gathered(native_kernels.gathered_dot, x, matrix, rows, rows.shape[-1])


def gathered_rows_sum(h: jax.Array, matrix: QuantizedTensor, rows: jax.Array):
    """``(h, values, scale, rows) -> [..., d]``: the weighted sum of the selected rows, read in place."""
    return _gathered(native_kernels.gathered_sum, h, matrix, rows, matrix.shape[-1])


def sparse_feed_forward_step(x: jax.Array, weights):
    """``(x, C1, C2, W1, W2) -> (y, choices)``: a sparse feed-forward layer's decode step in one
    call (``native_kernels.sparse_feed_forward``), where every weight is narrow of one store and C2
    is stored output-major."""
    rows = math.prod(x.shape[:-1])
    kind = _one_narrow_kind((weights.controller_down, weights.controller_up, weights.wi, weights.wo))
    if kind is None or not weights.controller_up.transposed or not fused_applies(x, rows, native_kernels.MAX_ROWS):
        return None
    n_ff = math.prod(weights.wi.shape[:-1])

    def pair(w, n_rows):
        values = w.values.reshape(n_rows, -1)
        return values, (w.scale.reshape(n_rows) if kind == "int8" else None)

    def native(x, down, up, wi, wo):
        y, chosen = native_kernels.sparse_feed_forward(
            x.reshape(rows, -1),
            pair(down, down.shape[0]),
            pair(up.output_major(), n_ff),
            weights.controller_bias,
            pair(wi, n_ff),
            pair(wo, n_ff),
            weights.wo_bias,
            kind,
        )
        return y.reshape(x.shape), chosen.reshape(x.shape[:-1] + chosen.shape[-1:])

    return native


def sparse_attention_step(x: jax.Array, weights, conv_rows: jax.Array, mode: Optional[str], cache=None):
    """``(x, conv_rows, cache, D, E, *convolution kernels) -> results``: a sparse QKV layer's decode
    step in one call (``native_kernels.sparse_attention``), where every weight is narrow of one
    store, the convolutions span the cached window, and the batch's modules fit the kernel.

    The fused attention reads float32 caches: over a narrow cache (bfloat16, int8;
    ``terra/backends/decode_state.py``) the fused call computes the projections and the attention is the
    native cache attention's (:func:`cache_attention`), its new key and value narrowed and written
    by XLA."""
    batch, n_modules = x.shape[0], weights.gate.shape[0]
    kernels = [kernel for kernel, _ in weights.convolutions]
    kind = _one_narrow_kind([weights.gate, weights.kernel] + kernels)
    length = conv_rows.shape[1] + 1
    if kind is None or any(kernel.shape[0] != length for kernel in kernels):
        return None
    if not fused_applies(x, batch * n_modules, native_kernels.MAX_INPUT_MAJOR_ROWS):
        return None
    narrow_cache = mode is not None and cache.key.dtype != jnp.float32

    def pair(w):
        return w.values, (w.scale if kind == "int8" else None)

    def native(x, conv_rows, cache, gate, kernel, *kernels):
        convs = [(pair(k), bias) for k, (_, bias) in zip(kernels, weights.convolutions)]
        attention = None
        if mode == "self" and not narrow_cache:
            key_mask = cache.key_mask if cache.key_mask is not None else jnp.ones((batch, cache.max_length), bool)
            attention = (mode, cache.key, cache.value, cache.index, key_mask)
        elif mode == "cross" and not narrow_cache:
            attention = (mode, cache.key, cache.value, cache.bias)
        outs, new_rows, attended = native_kernels.sparse_attention(
            x.reshape(batch, -1), pair(gate), pair(kernel), weights.bias, conv_rows, convs, kind, attention
        )
        if mode is None:
            return [o.reshape(batch, 1, n_modules, -1) for o in outs], new_rows, None
        if narrow_cache:
            return _narrow_cache_attention(mode, [o[:, :, None, :] for o in outs], cache, new_rows)
        if mode == "self":
            keys, values = attended[1:]
            written = dataclasses.replace(cache, key=keys, value=values, index=cache.index + 1)
            return attended[0].reshape(batch, 1, -1), new_rows, written
        return attended[0].reshape(batch, 1, -1), new_rows, None

    return native


def _narrow_cache_attention(mode: str, heads, cache, new_rows):
    """The attention of a sparse QKV step over a narrow cache, after the fused projections:
    ``heads`` ``[b, S, 1, M]`` (Q, K, V for ``"self"``; Q for ``"cross"``), ``cache`` as
    ``primitives.sparse_attention_step`` takes it; results as the fused call returns them. The read
    is the native cache attention where it applies (:func:`cache_attention`), else XLA's."""
    batch = heads[0].shape[0]
    native = cache_attention(heads[0], cache.key)
    attend = xla.cache_attention if native is None else native
    if mode == "self":
        y, written = xla.cached_attention(*heads, cache, None, attend=attend)
        return y.reshape(batch, 1, -1), new_rows, written
    q = heads[0] * jnp.asarray(heads[0].shape[-1] ** -0.5, heads[0].dtype)
    visible = jnp.asarray(cache.max_length, jnp.int32)
    bias = cache.bias.reshape(batch, cache.max_length)
    y = attend(q, cache.key, cache.value, bias, cache.key_scale, cache.value_scale, visible, None)
    return y.reshape(batch, 1, -1), new_rows, None


def _joined_softmax(out, top, total, own_logit=None, own_value=None):
    """A native attention's terms over the cached keys (``out = sum exp(l_j - top) v_j``, ``top``,
    ``total = sum exp(l_j - top)``, ``[b, h, d]`` and ``[b, h]``) normalised, joined first with the
    query's own key (``own_logit [b, h]``, ``own_value [b, h, d]``) where it has one: ``[b, h, d]``."""
    if own_logit is None:
        return out / total[..., None]
    joint = jnp.maximum(top, own_logit)
    past_weight, own_weight = jnp.exp(top - joint), jnp.exp(own_logit - joint)
    return (out * past_weight[..., None] + own_weight[..., None] * own_value) / (total * past_weight + own_weight)[
        ..., None
    ]


def cache_attention(q: jax.Array, keys: jax.Array):
    """``(q, keys, values, bias, key_scale, value_scale, visible, own) -> y``: a decode step's
    attention over a whole cache as one native call (``native_kernels.cache_attention``: the visible
    rows read where they lie, widened in registers), joined here with the query's own key; for one
    float32 query per head, a float32, int8 or bfloat16 cache and heads of at most
    ``MAX_CACHE_HEAD_SIZE``."""
    if q.dtype != jnp.float32 or q.ndim != 4 or q.shape[2] != 1 or str(keys.dtype) not in native_kernels.CACHE_KINDS:
        return None
    if q.shape[-1] > native_kernels.MAX_CACHE_HEAD_SIZE or not native_kernels.available():
        return None

    def native(q, keys, values, bias, key_scale, value_scale, visible, own, dropout=None):
        del dropout  # never given: the primitive keeps a dropout for its XLA form
        out, top, total = native_kernels.cache_attention(
            q[:, :, 0], keys, key_scale, values, value_scale, bias, visible
        )
        if own is None:
            return _joined_softmax(out, top, total)[:, :, None]
        k, v = own
        own_logit = jnp.sum(q * k, axis=-1)[:, :, 0]
        return _joined_softmax(out, top, total, own_logit, v[:, :, 0])[:, :, None].astype(v.dtype)

    return native


def lsh_bucket_attention(q: jax.Array, cache):
    """``(q, self_logit, v, q_buckets, cache) -> y``: an LSH layer's decode-step attention as one
    native call (``native_kernels.lsh_decode_attention``: the kept keys chosen from the bucket lists
    and their rows read in place), joined here with the token's own key; for float32 queries, at
    most ``MAX_LSH_ROUNDS`` hash rounds and a float32, int8 or bfloat16 cache."""
    kinds = native_kernels.CACHE_KINDS
    if q.dtype != jnp.float32 or str(cache.key.dtype) not in kinds or not native_kernels.fused_available():
        return None
    if cache.buckets.shape[2] > native_kernels.MAX_LSH_ROUNDS:
        return None

    def native(q, self_logit, v, q_buckets, cache):
        out, top, total = native_kernels.lsh_decode_attention(
            q[:, :, 0],
            cache.key,
            cache.key_scale,
            cache.value,
            cache.value_scale,
            cache.buckets,
            cache.bucket_positions,
            cache.bucket_counts,
            cache.recent_positions[:, 0],
            cache.recent_counts[:, 0],
            q_buckets,
        )
        y = _joined_softmax(out, top, total, self_logit[:, :, 0, 0], v[:, :, 0])
        return y[:, :, None].astype(v.dtype)

    return native


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool):
    """``(q, k, v, bias) -> y``: softmax attention over a whole input in one native call
    (``native_kernels.blocked_attention``), for float32 operands whose head size is a multiple of 16."""
    if not all(t.dtype == jnp.float32 for t in (q, k, v)) or q.shape[-1] % 16 or not native_kernels.available():
        return None

    def native(q, k, v, bias):
        scaled = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        rows = jnp.broadcast_to(bias.reshape(bias.shape[0], bias.shape[-1]), (q.shape[0], k.shape[2]))
        return native_kernels.blocked_attention(scaled, k, v, rows.astype(jnp.float32), causal)

    return native


def lsh_chunk_attention(q: jax.Array, n_chunks: int, before: int, after: int, causal: bool):
    """``(q, k, v, positions, valid) -> (out, lse)``: an LSH layer's attention over its sorted chunks
    in one native call (``native_kernels.lsh_chunk_attention``), for float32 entries whose head size
    is a multiple of 16, chunks of a multiple of 16 entries and a window no wider than the chunks."""
    if q.dtype != jnp.float32 or q.shape[-1] % 16 or q.shape[-2] % 16 or before + after + 1 > n_chunks:
        return None
    if not native_kernels.available():
        return None

    def native(q, k, v, positions, valid):
        out, lse = native_kernels.lsh_chunk_attention(q, k, v, positions, valid, before, after, causal)
        return out, lse

    return native


def lsh_hash(vecs: jax.Array, rotations: jax.Array, factors):
    """``(vecs, rotations) -> buckets``: an LSH layer's hash of a whole sequence in one native call
    (``native_kernels.lsh_hash``), for float32 operands and at most ``MAX_LSH_FACTORS`` factors."""
    if vecs.dtype != jnp.float32 or rotations.dtype != jnp.float32 or len(factors) > native_kernels.MAX_LSH_FACTORS:
        return None
    if not native_kernels.available():
        return None

    def native(vecs, rotations):
        return native_kernels.lsh_hash(vecs, rotations, factors)

    return native


def module_convolution(u: jax.Array, kernel: jax.Array):
    """``(u, kernel, bias) -> y``: a sparse-QKV convolution over a whole sequence in one native call
    (``native_kernels.module_convolution``), for float32 operands with an odd module kernel and a
    multiple of 16 output features."""
    if u.dtype != jnp.float32 or kernel.dtype != jnp.float32 or kernel.shape[-1] % 16 or kernel.shape[1] % 2 == 0:
        return None
    if not native_kernels.available():
        return None
    return native_kernels.module_convolution
