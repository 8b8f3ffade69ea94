"""The decode primitives the layers are written in, and how one is chosen per platform.

Each primitive takes a float32 array or a :class:`~terra.quantization.QuantizedTensor` and has an
XLA form (``terra/backends/xla.py``) that runs everywhere. A native backend (:data:`BACKENDS`,
keyed by the platform it lowers for) may offer its own form for the operands at hand; the
primitive then runs it in the program lowered for that platform (``lax.platform_dependent``: only
the branch of the platform lowered is compiled) and the XLA form elsewhere. The choice is made when
a function is traced.

A backend is a module with one function per primitive below that has native forms
(``output_major_product``, ``input_major_product``, ``transposed_chunk_rows``,
``gathered_rows_product``, ``gathered_rows_sum``, ``sparse_feed_forward_step``,
``sparse_attention_step``, ``cache_attention``, ``lsh_bucket_attention``, ``blocked_attention``,
``lsh_chunk_attention``, ``lsh_hash``, ``module_convolution``),
each returning the form or
``None`` (``terra/backends/cpu.py``).
"""

import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from terra.backends import cpu, decode_state, xla
from terra.quantization.quantized import QuantizedTensor

# The native backends, by the platform they lower for; every other platform runs the XLA forms.
BACKENDS = {cpu.PLATFORM: cpu}
# A weight as a parameter tree stores it: float, or narrow in a decode tree.
Weight = Union[jax.Array, QuantizedTensor]

cache_logits = xla.cache_logits
cache_weighted_values = xla.cache_weighted_values
write_after_read = decode_state.write_after_read
take_rows = xla.take_rows
attention_in_query_chunks = xla.attention_in_query_chunks


def _native_forms(primitive: str, *facts) -> dict:
    """``{platform: form}`` of the backends that have a form of ``primitive`` for ``facts``."""
    forms = {platform: getattr(backend, primitive)(*facts) for platform, backend in BACKENDS.items()}
    return {platform: form for platform, form in forms.items() if form is not None}


def _run(forms: dict, xla_form: Callable, *operands):
    """``xla_form(*operands)``, or each platform's native form in the program lowered for it."""
    if not forms:
        return xla_form(*operands)
    return lax.platform_dependent(*operands, default=xla_form, **forms)


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


def output_major_product(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in]`` times an output-major ``kernel [out, *in_axes]`` (``prod(in_axes) == in``)
    -> ``[..., out]``: a float kernel read in place as ``[out, in]`` in ``x``'s dtype (XLA:CPU
    streams this layout faster than ``[in, out]``; ``terra/layers/dense.py``), by a backend's
    kernel for a batch of a few rows (differentiated as XLA's product); a narrow one by a
    backend's kernel in decoding, else widened block by block."""
    if not isinstance(kernel, QuantizedTensor):
        kernel = jnp.asarray(kernel, x.dtype).reshape(-1, x.shape[-1])
        return _run_with_xla_derivative(_native_forms("float_output_major_product", x, kernel), xla.dot, x, kernel)
    n_out = kernel.values.size // x.shape[-1]
    values, scale = _rows(kernel, n_out)

    def widened(x, values, scale):
        return xla.widened_output_major(x, values, scale, kernel.kind)

    return _run(_native_forms("output_major_product", x, kernel, n_out), widened, x, values, scale)


def input_major_product(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in]`` times an input-major ``kernel [in, *out_axes]`` -> ``[..., prod(out_axes)]``:
    the layout of the small multiplicative and convolution kernels (``terra/layers/multiplicative.py``)
    and of the sparse feed-forward controller's up-projection, where a :class:`QuantizedTensor` has
    one scale per input row and run of ``out_axes[-1]`` outputs. A narrow kernel stored transposed,
    ``[*out_axes, in]`` (the decode tree's controller and sparse loss), is read output-major."""
    if not isinstance(kernel, QuantizedTensor):
        return x @ jnp.asarray(kernel, x.dtype).reshape(kernel.shape[0], -1)
    if kernel.transposed:
        return _transposed_product(x, kernel.output_major())
    n_in = kernel.values.shape[0]
    values = kernel.values.reshape(n_in, -1)
    scale = kernel.scale if kernel.kind == "bfloat16" else kernel.scale.reshape(n_in, -1)

    def widened(x, values, scale):
        return xla.widened_input_major(x, values, scale, kernel.kind)

    return _run(_native_forms("input_major_product", x, kernel), widened, x, values, scale)


def _transposed_product(x: jax.Array, kernel: QuantizedTensor) -> jax.Array:
    """``x [..., in]`` times an input-major kernel stored transposed (``kernel``: its output-major
    form), in chunks of rows where a backend reads more rows faster so (``transposed_chunk_rows``)."""
    chunks = [rows for rows in (b.transposed_chunk_rows(x) for b in BACKENDS.values()) if rows]
    if not chunks:
        return output_major_product(x, kernel)
    chunk, rows = min(chunks), math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1])
    parts = [output_major_product(flat[i : i + chunk], kernel) for i in range(0, rows, chunk)]
    return jnp.concatenate(parts).reshape(x.shape[:-1] + (-1,))


def _gathered(primitive: str, x: jax.Array, matrix, rows: jax.Array, xla_form) -> jax.Array:
    if not (isinstance(matrix, QuantizedTensor) and rows.shape[-1] > 0):
        return xla_form(x, matrix, rows)

    def widened(x, values, scale, rows):
        return xla_form(x, QuantizedTensor(values, scale, matrix.kind), rows)

    forms = _native_forms(primitive, x, matrix, rows)
    return _run(forms, widened, x, matrix.values, matrix.scale, rows)


def gathered_rows_product(x: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[..., j] = matrix[rows[..., j]] . x[...]``: ``x [..., d]``, ``matrix [n, d]`` (float32 or
    a :class:`QuantizedTensor`), ``rows [..., k]`` -> ``[..., k]`` (the selected rows of a sparse
    feed-forward layer's W1). A backend reads a narrow ``matrix``'s selected rows in place;
    otherwise the rows are gathered (and widened) first."""
    return _gathered("gathered_rows_product", x, matrix, rows, xla.gathered_rows_product)


def gathered_rows_sum(h: jax.Array, matrix, rows: jax.Array) -> jax.Array:
    """``y[...] = sum_j h[..., j] matrix[rows[..., j]]``: ``h [..., k]``, ``matrix [n, d]``,
    ``rows [..., k]`` -> ``[..., d]`` (the selected rows of W2), read as
    :func:`gathered_rows_product` reads them."""
    return _gathered("gathered_rows_sum", h, matrix, rows, xla.gathered_rows_sum)


def slice_rows(matrix, start: jax.Array, length: int) -> jax.Array:
    """``matrix[start : start + length]`` along axis 0 as float32 (a dynamic start), for a float32
    array or a :class:`QuantizedTensor` (only the sliced rows widened)."""
    return xla.read_rows(matrix, lambda a: lax.dynamic_slice_in_dim(a, start, length, axis=0))


def look_up_rows(table, tokens: jax.Array, dtype) -> jax.Array:
    """``table[tokens]`` in ``dtype`` (an embedding lookup): a float table cast whole and gathered,
    a narrow one's gathered rows widened with their own scales."""
    if isinstance(table, QuantizedTensor):
        return take_rows(table, tokens).astype(dtype)
    return jnp.take(jnp.asarray(table, dtype), tokens, axis=0)


def cache_attention(q, keys, values, bias, key_scale=None, value_scale=None, visible=None, own=None, dropout=None):
    """One decode step's attention of one query per head over a whole cache (a dense layer's
    self-attention over its KV cache, a cross-attention over the encoder's keys and values): ``q
    [b, h, 1, d]`` scaled by ``d ** -0.5``; ``keys``/``values [b, h, L, d]`` as the cache stores them
    (float, int8 with ``key_scale``/``value_scale [b, h, L]``, bfloat16 bits); ``bias [b, L]`` added
    to the logits; ``visible`` (int32 ``[]``, default ``L``): the bias hides every position from it
    on; ``own = (k, v) [b, h, 1, d]``, the query's own key and value (self-attention); ``dropout``
    on the probabilities. Returns ``y [b, h, 1, d]`` float32. A backend's form (without dropout)
    reads only the visible rows, each widened in registers; the XLA form reads the cache in blocks
    (``xla.cache_attention``)."""
    if visible is None:
        visible = jnp.asarray(keys.shape[2], jnp.int32)
    if dropout is not None:
        return xla.cache_attention(q, keys, values, bias, key_scale, value_scale, visible, own, dropout)
    forms = _native_forms("cache_attention", q, keys)
    return _run(forms, xla.cache_attention, q, keys, values, bias, key_scale, value_scale, visible, own)


def cached_attention(q, k, v, cache: decode_state.KVCache, dropout=None):
    """One decode step of causal attention over a self-attention's ``KVCache``, written as
    ``xla.cached_attention`` describes (the new key and value written after the read), its read by
    :func:`cache_attention`: ``(y [b, h, 1, d], the cache written)``."""
    return xla.cached_attention(q, k, v, cache, dropout, attend=cache_attention)


class SparseFeedForwardWeights(NamedTuple):
    """A sparse feed-forward layer's weights as stored (``terra/layers/sparse_feedforward.py``):
    the controller's C1 ``[L, d]`` (output-major), C2 ``[L, d_ff / N, N]`` and its bias
    ``[d_ff / N, N]``, W1 and W2 ``[d_ff / N, N, d]``, the output bias ``[d]``."""

    controller_down: Weight
    controller_up: Weight
    controller_bias: jax.Array
    wi: Weight
    wo: Weight
    wo_bias: jax.Array


def sparse_feed_forward_step(
    x: jax.Array, weights: SparseFeedForwardWeights, unfused: Callable[[jax.Array], Tuple[jax.Array, jax.Array]]
) -> Optional[Tuple[jax.Array, jax.Array]]:
    """A sparse feed-forward layer's decode step (controller, block choice, the chosen rows of W1
    and W2) as one backend call: ``x [..., d]`` -> ``(y [..., d], choices [..., d_ff / N])``, the
    same floats as ``unfused(x)`` (the step written in the other primitives), which runs on the
    platforms without the fused form. ``None`` where no backend fuses these weights: the layer
    then computes its step from the other primitives."""
    forms = _native_forms("sparse_feed_forward_step", x, weights)
    if not forms:
        return None
    narrow = (weights.controller_down, weights.controller_up, weights.wi, weights.wo)
    leaves, structure = jax.tree.flatten(narrow)

    def from_leaves(form):
        return lambda x, *leaves: form(x, *jax.tree.unflatten(structure, leaves))

    def default(x, *leaves):
        del leaves
        return unfused(x)

    return lax.platform_dependent(
        x, *leaves, default=default, **{platform: from_leaves(form) for platform, form in forms.items()}
    )


class SparseAttentionWeights(NamedTuple):
    """A sparse QKV layer's weights as stored (``terra/layers/sparse_qkv.py``): the multiplicative
    layer's D ``[S, d]``, E ``[d, M]`` and bias ``[S * M]``, and its convolutions, each
    ``(kernel [F, k, M, M_out], bias [M_out])``."""

    gate: Weight
    kernel: Weight
    bias: jax.Array
    convolutions: Sequence[Tuple[Weight, jax.Array]]


def sparse_attention_step(
    x: jax.Array,
    weights: SparseAttentionWeights,
    conv_rows: jax.Array,
    mode: Optional[str],
    cache,
    unfused: Callable,
):
    """A sparse QKV layer's decode step (the multiplicative layer, the convolution window, the
    convolutions and with ``mode`` the attention) as one backend call.

    ``x [b, 1, d]``; ``conv_rows [b, F - 1, S, M]`` (the cached rows of the multiplicative layer's
    output). ``mode``: ``None`` returns ``([each convolution's [b, 1, S, M_out]], new conv rows,
    None)``; ``"self"`` over the layer's own ``KVCache`` ``cache`` (Q, K, V the three convolutions)
    returns ``(y [b, 1, d], new conv rows, the cache written)`` and ``"cross"`` over the encoder's
    ``KVCache`` (Q the one convolution) ``(y [b, 1, d], new conv rows, None)``
    (``terra/backends/decode_state.py``).
    ``unfused(x, conv_rows, cache)`` computes the same from the other primitives and runs on the
    platforms without the fused form. ``None`` where no backend fuses these weights."""
    forms = _native_forms("sparse_attention_step", x, weights, conv_rows, mode, cache)
    if not forms:
        return None
    narrow = [weights.gate, weights.kernel] + [kernel for kernel, _ in weights.convolutions]
    leaves, structure = jax.tree.flatten(narrow)

    def from_leaves(form):
        return lambda x, conv_rows, cache, *leaves: form(x, conv_rows, cache, *jax.tree.unflatten(structure, leaves))

    def default(x, conv_rows, cache, *leaves):
        del leaves
        return unfused(x, conv_rows, cache)

    return lax.platform_dependent(
        x,
        conv_rows,
        cache,
        *leaves,
        default=default,
        **{platform: from_leaves(form) for platform, form in forms.items()},
    )


def fused_feed_forward_rows(x: jax.Array, weights: SparseFeedForwardWeights) -> int:
    """The most rows of ``x`` (float dtype and width as ``x``'s) that some backend's fused sparse
    feed-forward step takes in one call with these weights, or 0 where none fuses them. A long
    deterministic call (a prefill) runs that step over chunks of this many tokens, computing only
    the chosen units instead of every unit masked."""
    best = 0
    for backend in BACKENDS.values():
        rows = backend.FUSED_STEP_ROWS
        probe = jax.ShapeDtypeStruct((rows, x.shape[-1]), x.dtype)
        if backend.sparse_feed_forward_step(probe, weights) is not None:
            best = max(best, rows)
    return best


def lsh_bucket_attention(
    q: jax.Array,
    self_logit: jax.Array,
    v: jax.Array,
    q_buckets: jax.Array,
    cache: decode_state.LSHCache,
    unfused: Callable,
) -> jax.Array:
    """An LSH layer's decode-step attention: the past keys its rule keeps (same bucket as the
    query in any round, newest first, then the newest others; ``C`` in all) and the token's own
    key, one softmax. ``q [b, h, 1, d]`` scaled by ``d ** -0.5``; ``self_logit [b, h, 1, 1]`` the
    own key's logit with its exclude-self offset; ``v [b, h, 1, d]`` the own value; ``q_buckets
    [b, h, R]`` (−1: a padded query); ``cache`` the layer's ``LSHCache`` with its bucket lists.
    Returns ``y [b, h, 1, d]``. ``unfused(q, self_logit, v, q_buckets, cache)`` computes the same
    in XLA and runs where no backend has a form."""
    forms = _native_forms("lsh_bucket_attention", q, cache)
    return _run(forms, unfused, q, self_logit, v, q_buckets, cache)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, *, causal: bool, chunk: int):
    """Softmax attention over a whole input without dropout (a prefill, an evaluation): ``q [b, h,
    lq, d]``, ``k``/``v [b, h, lk, d]``, ``bias [b|1, 1, 1, lk]`` the same for every query, ``causal``
    (``lq == lk``) -> ``[b, h, lq, d]``, never holding the ``[b, h, lq, lk]`` scores. A backend's
    form runs blocks of queries against tiles of keys with an online softmax; the XLA form
    (``attention_in_query_chunks``) attends ``chunk`` queries at a time. Differentiating it
    differentiates the XLA form (recomputed), whichever form ran forward."""

    def chunked(q, k, v, bias):
        return xla.attention_in_query_chunks(q, k, v, bias, causal=causal, chunk=chunk)

    forms = _native_forms("blocked_attention", q, k, v, causal)
    return _run_with_xla_derivative(forms, chunked, q, k, v, bias)


def lsh_chunk_attention(q, k, v, positions, valid, *, before: int, after: int, causal: bool, unfused: Callable):
    """An LSH layer's attention over its sorted entries, without dropout: ``q``, ``k``, ``v`` ``[b, h,
    n, c, d]`` (``k`` length-normalised, scaled by ``d ** -0.5``), ``positions``, ``valid`` ``[b, h,
    n, c]``; each chunk attends to itself and its ``before`` previous and ``after`` next chunks with
    the layer's masks. Returns ``(out [b, h, n, c, d], lse [b, h, n, c])``. ``unfused(q, k, v,
    positions, valid)`` computes the same in XLA: it runs where no backend has a form, and its
    derivative is the derivative whichever form ran forward (recomputed)."""
    forms = _native_forms("lsh_chunk_attention", q, q.shape[2], before, after, causal)
    return _run_with_xla_derivative(forms, unfused, q, k, v, positions, valid)


def lsh_hash(vecs: jax.Array, rotations: jax.Array, factors: Tuple[int, ...], unfused: Callable) -> jax.Array:
    """An LSH layer's bucket ids for a whole sequence: ``vecs [b, h, l, d]``, ``rotations [h, d, R,
    sum(factors) / 2]`` -> ``[b, h, R, l]`` int32. ``unfused(vecs, rotations)`` computes the same in
    XLA and runs where no backend has a form. Buckets are discrete: no gradient flows through them
    (the operands are taken as constants, so a native form needs no derivative)."""
    vecs, rotations = lax.stop_gradient(vecs), lax.stop_gradient(rotations)
    return _run(_native_forms("lsh_hash", vecs, rotations, tuple(factors)), unfused, vecs, rotations)


def module_convolution(u: jax.Array, kernel: jax.Array, bias: jax.Array, unfused: Callable) -> jax.Array:
    """A sparse-QKV layer's convolution over a whole sequence: ``u [b, l, S, M]``, ``kernel [F, k, M,
    N]`` and ``bias [N]`` (float) -> ``[b, l, S, N]``, causal in length, the module axis zero-padded
    by ``(k - 1) / 2`` on each side. ``unfused(u, kernel, bias)`` computes the same in XLA: it runs
    where no backend has a form, and its derivative is the derivative whichever form ran forward
    (the convolution is linear, so its transpose needs no recomputed forward)."""
    forms = _native_forms("module_convolution", u, kernel)
    return _run_with_xla_derivative(forms, unfused, u, kernel, bias)


def _run_with_xla_derivative(forms: dict, xla_form: Callable, *operands):
    """:func:`_run`, differentiated as ``xla_form`` (recomputed in the backward pass) whichever form
    ran forward: for native forms that have no derivative of their own. Integer operands get no
    cotangent (``float0``), as ``jax.vjp`` gives them."""
    if not forms:
        return xla_form(*operands)

    @jax.custom_vjp
    def run(*operands):
        return _run(forms, xla_form, *operands)

    def forward(*operands):
        return run(*operands), operands

    def backward(operands, grads):
        return jax.vjp(xla_form, *operands)[1](grads)

    run.defvjp(forward, backward)
    return run(*operands)
