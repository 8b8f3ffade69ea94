"""LSH attention's sort-and-chunk attention over given buckets (the reference's
``forward_unbatched``; ``docs/design/reference_code.md`` §4.5): sort every hash round's entries by
(round, bucket, position), attend within each chunk and its neighbours with the layer's causal,
exclude-self and padding masks, unsort and combine the rounds by their log-sum-exps; and the dense
shared-QK attention with the same masks that one chunk per round equals. The layer that hashes
and calls it is ``terra/layers/lsh_attention.py``.
"""

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from terra.backends import lsh_chunk_attention
from terra.layers.attention import MASK_VALUE

# Additive logit for a query's own key (the reference's exclude_self: dots - 1e5).
SELF_MASK_VALUE = -1e5


def length_normalized(x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """``x / sqrt(mean(x²) + eps)`` over the last axis (the shared-QK key normalisation)."""
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(variance + jnp.asarray(epsilon, x.dtype))


def stable_order(keys: jax.Array, n_keys: int) -> Tuple[jax.Array, jax.Array]:
    """``(order, sorted_keys)``: the indices that sort ``keys`` ``[..., n]`` (ints in ``[0,
    n_keys)``) stably along the last axis, int32, and the keys in that order.

    Where ``n_keys · n`` fits in int32, one sort of ``key · n + index`` (distinct, so stability
    is free): XLA:CPU sorts one int32 operand much faster than the (key, index) pair of a stable
    argsort (docs/architecture.md, "The LSH prefill's bookkeeping")."""
    n, axis = keys.shape[-1], keys.ndim - 1
    if n_keys * n < 2**31:
        combined = keys.astype(jnp.int32) * n + lax.broadcasted_iota(jnp.int32, keys.shape, axis)
        ordered = lax.sort(combined, dimension=axis, is_stable=False)
        return ordered % n, ordered // n
    order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    return order, jnp.take_along_axis(keys, order, axis=-1)


def inverse_permutation(perm: jax.Array) -> jax.Array:
    """``undo`` with ``undo[..., perm[..., i]] = i`` for permutations ``perm`` ``[..., n]`` of the
    last axis: one scatter, far cheaper than an argsort of ``perm`` (docs/architecture.md)."""
    n = perm.shape[-1]
    rows = perm.reshape(-1, n)
    index = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    undo = jnp.zeros_like(rows).at[jnp.arange(rows.shape[0])[:, None], rows].set(index, unique_indices=True)
    return undo.reshape(perm.shape)


def look_adjacent(x: jax.Array, n_chunks_before: int, n_chunks_after: int, axis: int) -> jax.Array:
    """``[..., n_chunks, chunk_len, ...]`` -> each chunk followed (along ``axis + 1``) by its
    ``n_chunks_before`` previous and ``n_chunks_after`` next chunks, cyclically (the
    reference's ``look_adjacent``: chunk 0's previous chunk is the last one)."""
    if n_chunks_before == 0 and n_chunks_after == 0:
        return x
    parts = [x if i == 0 else jnp.roll(x, -i, axis=axis) for i in range(-n_chunks_before, n_chunks_after + 1)]
    return jnp.concatenate(parts, axis=axis + 1)


def _mask_bias(q_pos, k_pos, k_valid, causal: bool) -> jax.Array:
    """Additive float32 bias from positions ``q_pos [..., q, 1]``, ``k_pos [..., 1, k]`` and
    key validity ``k_valid [..., 1, k]`` (the reference's ``mask_self_attention``)."""
    # A padding key is never "self" (the reference negates padded keys' position info).
    bias = jnp.where((q_pos == k_pos) & k_valid, SELF_MASK_VALUE, 0.0)
    if causal:
        bias = bias + jnp.where(q_pos < k_pos, MASK_VALUE, 0.0)
    bias = bias + jnp.where(k_valid, 0.0, MASK_VALUE)
    return bias.astype(jnp.float32)


def full_shared_qk_attention(
    q: jax.Array, v: jax.Array, key_mask: Optional[jax.Array] = None, *, causal: bool = True
) -> jax.Array:
    """Dense reference: full shared-QK attention with LSH attention's masks (causal,
    exclude-self, padding). ``q``, ``v`` ``[batch, heads, length, d]``; ``key_mask``
    ``[batch, length]`` (1 = real token) -> ``[batch, heads, length, d]``."""
    length = q.shape[2]
    k = length_normalized(q) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    pos = jnp.arange(length)
    valid = jnp.ones((q.shape[0], length), bool) if key_mask is None else key_mask.astype(bool)
    logits = logits + _mask_bias(pos[:, None], pos[None, :], valid[:, None, None, :], causal)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v)


def attention_in_chunks(cq, ck, cv, cpos, cvalid, *, before: int, after: int, causal: bool, dropout=None):
    """Each sorted chunk's attention over itself and its ``before`` previous and ``after`` next
    chunks (``look_adjacent``), with the layer's masks: ``cq``, ``ck`` (length-normalised, scaled),
    ``cv`` ``[b, h, n, c, d]``, ``cpos``, ``cvalid`` ``[b, h, n, c]`` -> (``[b, h, n, c, d]``, the
    logsumexp ``[b, h, n, c]``). The XLA form of ``backends.lsh_chunk_attention``."""
    ck = look_adjacent(ck, before, after, axis=2)
    cv = look_adjacent(cv, before, after, axis=2)
    kpos = look_adjacent(cpos, before, after, axis=2)
    kvalid = look_adjacent(cvalid, before, after, axis=2)
    logits = jnp.einsum("bhncd,bhnkd->bhnck", cq, ck).astype(jnp.float32)
    logits = logits + _mask_bias(cpos[..., :, None], kpos[..., None, :], kvalid[..., None, :], causal)
    # Normalise against the row maximum (not as exp(logits - logsumexp)): a row whose best
    # key is its own (-1e5) would otherwise lose float32 precision in the probabilities.
    row_max = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnormalized = jnp.exp(logits - row_max)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    probs = unnormalized / total
    lse = row_max + jnp.log(total)
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("bhnck,bhnkd->bhncd", probs.astype(cv.dtype), cv), lse[..., 0]


def lsh_attention(
    q: jax.Array,
    v: jax.Array,
    buckets: jax.Array,
    n_total_buckets: int,
    key_mask: jax.Array,
    *,
    chunk_len: int,
    n_chunks_before: int,
    n_chunks_after: int,
    causal: bool,
    dropout=None,
) -> jax.Array:
    """Sort-and-chunk shared-QK attention over given buckets.

    ``q``, ``v``: ``[batch, heads, length, d]`` with ``length % chunk_len == 0``;
    ``buckets``: ``[batch, heads, n_hashes, length]`` in ``[0, n_total_buckets)`` (padding
    positions already in their own bucket); ``key_mask``: ``[batch, length]`` bool;
    ``dropout``: optional ``probs -> probs`` applied to ``[b, h, chunks, chunk_len,
    window]`` attention probabilities. Returns ``[batch, heads, length, d]``.
    """
    batch, heads, length, d = q.shape
    n_hashes = buckets.shape[2]
    if length % chunk_len:
        raise ValueError(f"lsh_attention: length {length} is not a multiple of chunk_len {chunk_len}.")
    offsets = (jnp.arange(n_hashes, dtype=jnp.int32) * n_total_buckets)[:, None]
    flat = lax.stop_gradient((buckets + offsets).reshape(batch, heads, n_hashes * length))
    # A stable sort of the offset bucket ids orders by (round, bucket, position): the
    # entries of each round are laid out in position order before sorting.
    perm, _ = stable_order(flat, n_hashes * n_total_buckets)
    undo = inverse_permutation(perm)
    pos = perm % length  # sorted entry -> position  [b, h, n_hashes·length]

    # The indices come from permutations: in bounds and never negative, so the gathers need
    # neither XLA's bounds selects nor negative-index wrapping (a select per element each).
    take = functools.partial(jnp.take_along_axis, axis=2, mode="promise_in_bounds", wrap_negative_indices=False)
    sq, sv = take(q, pos[..., None]), take(v, pos[..., None])
    sk = length_normalized(sq) * jnp.asarray(d**-0.5, sq.dtype)
    svalid = take(jnp.broadcast_to(key_mask[:, None, :], (batch, heads, length)), pos)

    n_chunks = n_hashes * length // chunk_len
    chunked = lambda t: t.reshape((batch, heads, n_chunks, chunk_len) + t.shape[3:])  # noqa: E731
    attend = functools.partial(
        attention_in_chunks, before=n_chunks_before, after=n_chunks_after, causal=causal, dropout=dropout
    )
    operands = (chunked(sq), chunked(sk), chunked(sv), chunked(pos), chunked(svalid))
    if dropout is None:  # a backend may run it natively (a prefill, an evaluation)
        so, slse = lsh_chunk_attention(
            *operands, before=n_chunks_before, after=n_chunks_after, causal=causal, unfused=attend
        )
    else:
        so, slse = attend(*operands)
    so = so.reshape(batch, heads, n_hashes * length, d)
    slse = slse.reshape(batch, heads, n_hashes * length)

    o = take(so, undo[..., None]).reshape(batch, heads, n_hashes, length, d)
    return combined_rounds(o, take(slse, undo).reshape(batch, heads, n_hashes, length))


def combined_rounds(o: jax.Array, round_lse: jax.Array) -> jax.Array:
    """The hash rounds' outputs ``o [b, h, n_hashes, length, d]`` weighted by the softmax of their
    log-sum-exps ``round_lse [b, h, n_hashes, length]`` (each round's share of the probability
    mass): ``[b, h, length, d]``."""
    weights = jax.nn.softmax(round_lse, axis=2)[..., None].astype(o.dtype)
    # The rounds summed one by one: as a reduction XLA:CPU made it a product over the n_hashes
    # axis (docs/architecture.md).
    combined = o[:, :, 0] * weights[:, :, 0]
    for r in range(1, o.shape[2]):
        combined = combined + o[:, :, r] * weights[:, :, r]
    return combined
