"""LSH (locality-sensitive hashing) self-attention, the Reformer attention that the
Terraformer uses for long sequences (paper §4; reference ``efficient_attention.py:
LSHSelfAttention``, ``docs/design/reference_code.md`` §4.5 and, for the sparse projections, §2.5b).

Full forward (train/eval), per example and head, as the reference's ``forward_unbatched``:

  q, v = projections of x             shared QK: keys are the RMS-normalised queries,
  k = q / sqrt(mean(q²) + 1e-6) / sqrt(d_head)      queries are not normalised
  buckets = argmax([qR, -qR])         R ~ N(0, 1) [d_head, n_hashes, n_buckets/2] per head;
                                      padding positions go to an extra bucket, and each
                                      hash round's ids are offset so rounds never mix
  sort by (round, bucket, position),  split the n_hashes·L sorted entries into chunks of
                                      ``chunk_len``; each chunk attends to itself plus
                                      ``n_chunks_before`` previous and ``n_chunks_after``
                                      next chunks (cyclically, as ``look_adjacent``)
  masks                               causal −1e9 where q_pos < k_pos; exclude-self −1e5
                                      where q_pos == k_pos (a token sees itself only when
                                      nothing else is visible); padding −1e9
  unsort and combine the rounds       o = Σ_r softmax_r(logsumexp_r) · o_r

A sequence whose length is not a multiple of ``chunk_len`` is padded at the end (the padded
positions are masked keys in the extra bucket), so a sequence of at most ``chunk_len``
tokens is one chunk per round and LSH attention then equals full shared-QK attention with
the same masks (``full_shared_qk_attention``; also the module's ``std_length`` path).

Causality. Queries never attend to later keys. The *chunk assignment* however depends on
every position's bucket (a later token hashed into a lower bucket shifts the chunk
boundaries), exactly as in the reference, so with buckets recomputed an earlier output can
change when a later token changes which *earlier* keys share its chunk. With the buckets
fixed (``buckets=``) the output at position i depends only on tokens ≤ i.

Hash rotations come from, in order: the ``'lsh'`` rng stream if the caller provides one;
the ``'dropout'`` stream in training (``deterministic=False``), so a fresh hash is drawn
per step like the reference's per-call state rng; otherwise a fixed seed,
``(hash_seed, crc32(module path))`` (deterministic eval, distinct per layer). The normal
draw itself uses an ``'rbg'`` key seeded from that key (``hashing_key``).
Rotations are drawn per head and shared by the examples of a batch (the reference draws
them per example and head); an example's output therefore never depends on its batch.

The buckets used are sown as ``intermediates/buckets`` ``[batch, heads, n_hashes, length]``
(int32; padding positions hold the extra bucket id) and can be passed back with
``buckets=`` so a reversible layer's recomputation makes the same hashing decisions (the
reference keeps them in the layer state for ``reverse_and_grad``).

Decode (causal only; the reference's ``_incremental_forward_unbatched``). The cache holds,
head-major as ``CausalSelfAttention``'s, the normalised keys and the values of every past
token ``[batch, heads, max_decode_length, d_head]`` (stored as ``cache_dtype``:
``terra.backends.decode_state``), their buckets ``[batch, heads, n_hashes, max_decode_length]``
(−1 = empty or padding) and the rotations. For the new token, past keys are ranked as the
reference ranks them (``docs/design/reference_code.md`` §4.5) — first those sharing its
bucket in any hash round, then by recency — and the top
``n_keep = n_hashes · chunk_len · (1 + n_chunks_before) − 1`` are attended to together with the
token itself (the reference keeps ``n_hashes · chunk_len · (1 + n_chunks_before)`` keys including
the token itself), with the same causal/exclude-self/padding masks and one softmax (no
per-round combination, as the reference).

Ranking every cached position costs O(max_decode_length) per step and layer
(``select_from_whole_cache``, ``decode_candidates='all'``). By default
(``decode_candidates='buckets'``) the cache also keeps ring buffers of positions: per (round,
bucket) the latest ``n_keep`` real positions hashed there, ``bucket_positions [batch, heads,
n_hashes, n_buckets, n_keep]`` int32 (−1 = empty) with ``bucket_counts [batch, heads, n_hashes,
n_buckets]``, and the latest ``n_keep`` real positions, ``recent_positions [batch, 1, n_keep]``
with ``recent_counts [batch, 1]``. A step ranks only the ≤ ``(n_hashes + 1) · n_keep``
positions of its own buckets' lists and the recent list (``select_from_bucket_lists``, which
chooses exactly the same keys: the proof is in its docstring) and reads (and widens) only the
kept key/value rows, so its cost no longer grows with the context. Memory: 4 · n_hashes ·
n_buckets · n_keep bytes per head and example, 8 MiB per layer at the arXiv decoder's 16 heads,
2 rounds, 128 buckets, n_keep 511 (the float32 key/value cache of 16,384 positions is 128 MiB).

Differences from the reference: keys/values are cached instead of recomputed from a cache of
inputs; the memory is the full ``max_decode_length`` cache (the reference's
``predict_mem_len`` with rolling ``predict_drop_len`` drops is not implemented: a cache never
wraps); auto ``n_buckets`` is computed from ``max_decode_length`` (the reference recomputes it
from the 2-row query buffer); like ``CausalSelfAttention`` the cache-creating call runs the full
forward and writes nothing, unless it is given ``prefix_mask`` (a multi-token prefill that
hashes and writes the prefix's keys, padded ones with bucket −1, and fills the position lists).
Decode equals the full forward whenever every past key is kept, e.g. for sequences of at most
``chunk_len`` tokens; beyond that both are approximations of full attention by different
selection rules (as in the reference).
"""

import dataclasses
import functools
import math
import zlib
from typing import Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from terra.backends import (
    LSHCache,
    as_float,
    check_cache_dtype,
    get_state,
    has_state,
    lsh_bucket_attention,
    lsh_chunk_attention,
    lsh_hash,
    put_state,
    widen_rows,
    write_after_read,
)
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.attention import MASK_VALUE, output_projection
from terra.layers.dense import Dense
from terra.layers.initializers import stacked_glorot_uniform
from terra.layers.multiplicative import MultiplicativeDense
from terra.layers.selection import block_argmax
from terra.layers.sparse_qkv import (
    ConvolutionCacheMixin,
    ModuleConvolution,
    attention_sparsity_modules,
    convolve_modules,
)

# Additive logit for a query's own key (the reference's exclude_self: dots - 1e5).
SELF_MASK_VALUE = -1e5
# Above this many buckets the automatic choice factorises the hash (as the reference).
MAX_UNFACTORED_BUCKETS = 128
WEIGHTS_FORMATS = ("model", "sparse")
DECODE_CANDIDATES = ("buckets", "all")

NBuckets = Union[int, Sequence[int], None]


def length_normalized(x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    """``x / sqrt(mean(x²) + eps)`` over the last axis (the shared-QK key normalisation)."""
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(variance + jnp.asarray(epsilon, x.dtype))


def bucket_factors(n_buckets: NBuckets, length: int, chunk_len: int) -> Tuple[int, ...]:
    """The hash's bucket factors: ``(n,)`` for ``n`` buckets, several for a factorised hash.

    ``None`` means automatic: ``n = 2·max(1, length // chunk_len)``, factorised above 128
    buckets as ``[2^ceil(log2 sqrt n), 2·(n // (2·that))]`` (the reference's rule).
    """
    if n_buckets is None:
        n = 2 * max(1, length // chunk_len)
        if n <= MAX_UNFACTORED_BUCKETS:
            factors: Tuple[int, ...] = (n,)
        else:
            first = 2 ** math.ceil(math.log2(math.sqrt(n)))
            factors = (first, 2 * (n // (2 * first)))
    elif isinstance(n_buckets, int):
        factors = (n_buckets,)
    else:
        factors = tuple(int(f) for f in n_buckets)
    if not factors or any(f <= 0 or f % 2 for f in factors):
        raise ConfigError(
            f"LSH n_buckets={n_buckets!r} gives factors {factors}; every factor must be even and positive."
        )
    return factors


def hashing_key(key: jax.Array) -> jax.Array:
    """An ``'rbg'`` key (XLA's RngBitGenerator) seeded from ``key`` (a typed key of any
    implementation, or raw ``uint32`` key data).

    Hashing needs no more than a fair draw, and XLA:CPU compiles threefry bits several times
    more slowly than RngBitGenerator, per LSH layer of a compiled model. The values drawn may
    differ across XLA versions and backends; a reversible layer replays *buckets*
    (``buckets=``), not rotations, so nothing relies on bitwise-stable rotations.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    data = jnp.resize(jnp.asarray(key).reshape(-1).astype(jnp.uint32), (4,))
    data = data ^ jnp.asarray([0, 0, 0x9E3779B9, 0x85EBCA6B], jnp.uint32)
    return jax.random.wrap_key_data(data, impl="rbg")


def draw_rotations(key: jax.Array, n_heads: int, d_head: int, n_hashes: int, factors: Tuple[int, ...]) -> jax.Array:
    """Random rotations ``R ~ N(0, 1)`` ``[heads, d_head, n_hashes, sum(factors) / 2]``."""
    return jax.random.normal(hashing_key(key), (n_heads, d_head, n_hashes, sum(factors) // 2), jnp.float32)


def hash_vectors(vecs: jax.Array, rotations: jax.Array, factors: Tuple[int, ...]) -> jax.Array:
    """Angular LSH: ``vecs`` ``[batch, heads, length, d]`` -> buckets ``[batch, heads,
    n_hashes, length]`` in ``[0, prod(factors))``; ``bucket = argmax([xR, -xR])`` per factor,
    combined mixed-radix for a factorised hash. A backend may hash in one call
    (``terra.backends.lsh_hash``: XLA:CPU writes the rotated floats out and reads them back for
    the argmax, several times the product's time at a prefill's lengths)."""

    def unfused(vecs, rotations):
        return _buckets(jnp.einsum("bhld,hdrk->bhrlk", vecs, rotations), factors)

    return lsh_hash(vecs.astype(jnp.float32), rotations.astype(jnp.float32), factors, unfused)


def hash_query(q: jax.Array, rotations_by_row: jax.Array, factors: Tuple[int, ...]) -> jax.Array:
    """:func:`hash_vectors` of a decode step's one position: ``q [batch, heads, d]`` with the
    rotations stored ``[heads, n_hashes, sum(factors) / 2, d]`` (d last, so the product reads
    them in place: in the layout ``hash_vectors`` takes, XLA:CPU copied them transposed at every
    step of every layer) -> buckets ``[batch, heads, n_hashes]``."""
    rotated = jnp.einsum("bhd,hrkd->bhrk", q.astype(jnp.float32), rotations_by_row)
    return _buckets(rotated[:, :, :, None, :], factors)[..., 0]


def _buckets(rotated: jax.Array, factors: Tuple[int, ...]) -> jax.Array:
    """``rotated [..., sum(factors) / 2]`` -> buckets ``[...]``."""
    buckets, start, radix = None, 0, 1
    for factor in factors:
        part = rotated[..., start : start + factor // 2]
        start += factor // 2
        b = signed_argmax(part)
        buckets = b if buckets is None else buckets + radix * b
        radix *= factor
    return buckets


def signed_argmax(x: jax.Array) -> jax.Array:
    """``block_argmax(concatenate([x, -x], -1))`` (first index of the maximum, NaN counting as
    the maximum) from ``x``'s maximum and minimum, without building the negated copy (in a
    prefill's hash a float32 ``[heads, 2, length, 128]`` per layer)."""
    half = x.shape[-1]
    top, bottom = jnp.max(x, axis=-1), jnp.min(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first_bottom = jnp.min(jnp.where(x == bottom, index, half), axis=-1)
    # A tie between the maximum and the negated minimum goes to the first half, as argmax's.
    use_top = (top >= -bottom[..., 0]) | jnp.isnan(top)
    return jnp.where(use_top, block_argmax(x), half + first_bottom)


def stable_order(keys: jax.Array, n_keys: int) -> Tuple[jax.Array, jax.Array]:
    """``(order, sorted_keys)``: the indices that sort ``keys`` ``[..., n]`` (ints in ``[0,
    n_keys)``) stably along the last axis, int32, and the keys in that order.

    Where ``n_keys · n`` fits in int32, one sort of ``key · n + index`` (distinct, so stability
    is free): XLA:CPU sorts one int32 operand about 3x faster than the (key, index) pair of a
    stable argsort (24 against 73 ms for a prefill's ``[16, 30720]`` bucket ids)."""
    n, axis = keys.shape[-1], keys.ndim - 1
    if n_keys * n < 2**31:
        combined = keys.astype(jnp.int32) * n + lax.broadcasted_iota(jnp.int32, keys.shape, axis)
        ordered = lax.sort(combined, dimension=axis, is_stable=False)
        return ordered % n, ordered // n
    order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    return order, jnp.take_along_axis(keys, order, axis=-1)


def inverse_permutation(perm: jax.Array) -> jax.Array:
    """``undo`` with ``undo[..., perm[..., i]] = i`` for permutations ``perm`` ``[..., n]`` of the
    last axis: one scatter (about 1 ms for ``[16, 30720]``, where the argsort of ``perm`` takes 64)."""
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


def select_from_whole_cache(cached_buckets: jax.Array, q_buckets: jax.Array, n_keep: int) -> jax.Array:
    """The reference's choice of past keys for a decode step (``docs/design/reference_code.md``
    §4.5: same bucket as the query in any hash round first, then recency), over every cached
    position: O(max_len) per step.

    ``cached_buckets`` ``[batch, heads, n_hashes, max_len]`` (−1: empty or padding),
    ``q_buckets`` ``[batch, heads, n_hashes]`` (−1: a padded query, which shares no bucket).
    Returns the kept positions ``[batch, heads, n_keep]`` int32, −1 where fewer than ``n_keep``
    positions are valid. The reference for :func:`select_from_bucket_lists`.
    """
    max_len = cached_buckets.shape[-1]
    valid = cached_buckets[:, :, 0, :] >= 0
    same = jnp.any(cached_buckets == q_buckets[..., None], axis=2)
    position = jnp.arange(max_len, dtype=jnp.int32)
    priority = jnp.where(valid, position + max_len * same.astype(jnp.int32), -1)
    # float32 holds the priorities (< 2·max_len) exactly below 2^23 positions, and XLA:CPU's
    # float32 top_k is its fast path: over 16,384 positions 2.7 ms against 40 ms for int32.
    _, kept = lax.top_k(priority.astype(jnp.float32), n_keep)  # [b, h, n_keep]
    return jnp.where(jnp.take_along_axis(valid, kept, axis=2), kept, -1).astype(jnp.int32)


def select_from_bucket_lists(
    bucket_lists: jax.Array, recent: jax.Array, cached_buckets: jax.Array, q_buckets: jax.Array, n_keep: int
) -> jax.Array:
    """The same kept set as :func:`select_from_whole_cache`, ranked over at most
    ``(n_hashes + 1) · n_keep`` candidates instead of ``max_len`` positions.

    ``bucket_lists`` ``[batch, heads, n_hashes, capacity]``: per round, the latest (at most
    ``capacity``) valid positions hashed to the query's bucket of that round (−1: empty);
    ``recent`` ``[batch, capacity]``: the latest valid positions; ``cached_buckets``
    ``[batch, heads, n_hashes, max_len]``; ``q_buckets`` ``[batch, heads, n_hashes]`` (−1: a
    padded query). Returns ``[batch, heads, n_keep]`` int32 positions, −1 = none.

    Why the sets are equal when ``capacity >= n_keep``: the whole-cache rule keeps the
    ``n_keep`` valid positions of highest priority ``position + max_len · same`` (distinct
    priorities). A kept same-bucket position p has fewer than ``n_keep`` same-bucket positions
    after it, so in the first round r0 where it shares the query's bucket fewer than ``n_keep``
    positions of that bucket follow it: p is in round r0's list. A kept other position exists
    only when all S < ``n_keep`` same-bucket positions are kept, and p is then among the latest
    ``n_keep - S`` other positions: fewer than ``n_keep`` valid positions follow it, so p is in
    ``recent``. Duplicates are dropped: a round-r entry that shares the query's bucket in an
    earlier round (it is in that round's list, or it has ``n_keep`` same-bucket positions after
    it and is not kept), and a ``recent`` entry that shares it in any round (fewer than
    ``n_keep`` positions follow it, so it is in its first matching round's list). The
    candidates are then distinct valid positions with the right ``same`` flags and include the
    whole-cache choice, so their top ``n_keep`` by the same priority is that choice (in another
    order, which one softmax does not see).
    """
    batch, heads, n_hashes, capacity = bucket_lists.shape
    max_len = cached_buckets.shape[-1]
    lists = jnp.where(q_buckets[..., None] >= 0, bucket_lists, -1).reshape(batch, heads, n_hashes * capacity)
    candidates = jnp.concatenate([lists, jnp.broadcast_to(recent[:, None, :], (batch, heads, capacity))], axis=-1)
    # Each candidate's buckets in every round  [b, h, n_hashes, (n_hashes + 1) · capacity].
    their_buckets = jnp.take_along_axis(cached_buckets, jnp.maximum(candidates, 0)[:, :, None, :], axis=3)
    matches = their_buckets == q_buckets[..., None]
    source = jnp.repeat(jnp.arange(n_hashes + 1), capacity)  # an entry's round; n_hashes: recent
    earlier = jnp.arange(n_hashes)[:, None] < source[None, :]
    candidates = jnp.where(jnp.any(matches & earlier, axis=2), -1, candidates)
    priority = jnp.where(candidates >= 0, candidates + max_len * (source < n_hashes), -1)

    # The n_keep-th highest priority by bisection (the priorities are distinct integers in
    # [0, 2·max_len)); 0 when fewer than n_keep candidates are valid, so all of them are kept.
    # Cheaper on XLA:CPU than lax.top_k over the candidates (0.22-0.27 against 0.57 ms at 16
    # heads, n_keep 511), and the kept order does not matter.
    def bisect(_, bounds):
        low, high = bounds
        middle = (low + high + 1) // 2
        enough = jnp.sum(priority >= middle[..., None], axis=-1) >= n_keep
        return jnp.where(enough, middle, low), jnp.where(enough, high, middle - 1)

    low = jnp.zeros((batch, heads), jnp.int32)
    high = jnp.full((batch, heads), 2 * max_len, jnp.int32)
    threshold, _ = lax.fori_loop(0, (2 * max_len).bit_length(), bisect, (low, high))
    kept = priority >= threshold[..., None]  # at most n_keep per row
    slot = jnp.where(kept, jnp.cumsum(kept, axis=-1, dtype=jnp.int32) - 1, n_keep)
    rows = (jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None])
    out = jnp.full((batch, heads, n_keep), -1, jnp.int32)
    return out.at[rows + (slot,)].set(candidates, mode="drop")


def latest_positions(ids: jax.Array, n_ids: int, capacity: int) -> Tuple[jax.Array, jax.Array]:
    """Ring buffers of each id's latest ``capacity`` positions, all at once (the prefill).

    ``ids`` ``[..., length]`` int32 in ``[0, n_ids)``, or −1 for a position that joins no
    buffer. Returns ``buffers [..., n_ids, capacity]`` int32 and ``counts [..., n_ids]`` int32
    (positions per id): the position of rank j within its id (0 = earliest) is at slot
    ``j % capacity`` if it is among the id's last ``capacity``; other slots hold −1. This is
    what :func:`append_position` leaves after appending the positions one by one.
    """
    lead, length = ids.shape[:-1], ids.shape[-1]
    rows = math.prod(lead)
    key = jnp.where(ids >= 0, ids, n_ids).reshape(rows, length).astype(jnp.int32)
    # A stable sort by id keeps each id's positions in increasing order, so an entry's rank
    # within its id is its distance to the id's first sorted entry.
    order, sorted_ids = stable_order(key, n_ids + 1)
    counts = jax.vmap(lambda k: jnp.bincount(k, length=n_ids + 1))(key).astype(jnp.int32)
    starts = jnp.cumsum(counts, axis=-1) - counts
    rank = jnp.arange(length, dtype=jnp.int32) - jnp.take_along_axis(starts, sorted_ids, axis=-1)
    keep = (sorted_ids < n_ids) & (rank >= jnp.take_along_axis(counts, sorted_ids, axis=-1) - capacity)
    slot = jnp.where(keep, sorted_ids * capacity + rank % capacity, n_ids * capacity)
    buffers = jnp.full((rows, n_ids * capacity), -1, jnp.int32)
    buffers = jax.vmap(lambda b, i, o: b.at[i].set(o, mode="drop"))(buffers, slot, order)
    return buffers.reshape(lead + (n_ids, capacity)), counts[:, :n_ids].reshape(lead + (n_ids,))


def append_position(
    buffers: jax.Array, counts: jax.Array, ids: jax.Array, position: jax.Array
) -> Tuple[jax.Array, jax.Array]:
    """Appends ``position`` to the ring buffer of id ``ids[...]`` (−1: to none) of every row.

    ``buffers`` ``[..., n_ids, capacity]``, ``counts`` ``[..., n_ids]``, ``ids`` ``[...]``;
    the position overwrites the id's oldest slot, ``count % capacity``. One scatter per row:
    the step touches ``O(rows)`` entries, not the buffers.
    """
    n_ids, capacity = buffers.shape[-2:]
    rows = math.prod(ids.shape)
    flat_ids = ids.reshape(rows)
    real = flat_ids >= 0
    safe = jnp.where(real, flat_ids, 0)
    flat_counts = counts.reshape(rows, n_ids)
    count = jnp.take_along_axis(flat_counts, safe[:, None], axis=1)[:, 0]
    row = jnp.arange(rows)
    target = jnp.where(real, safe * capacity + count % capacity, n_ids * capacity)
    flat = buffers.reshape(rows, n_ids * capacity).at[row, target].set(position.astype(jnp.int32), mode="drop")
    flat_counts = flat_counts.at[row, jnp.where(real, safe, n_ids)].add(1, mode="drop")
    return flat.reshape(buffers.shape), flat_counts.reshape(counts.shape)


def read_rows(values: jax.Array, scales: Optional[jax.Array], rows: jax.Array, dtype) -> jax.Array:
    """Rows ``rows [batch, heads, n]`` (−1: any row, masked by the caller) of a cache stored as
    ``values [batch, heads, max_len, d]`` (with int8's ``scales [batch, heads, max_len]``), widened
    to ``dtype``: ``[batch, heads, n, d]``. Only these rows are widened."""
    safe = jnp.maximum(rows, 0)
    values = jnp.take_along_axis(values, safe[..., None], axis=2, mode="clip")
    scales = None if scales is None else jnp.take_along_axis(scales, safe, axis=2, mode="clip")
    return widen_rows(values, scales, dtype)


def attend_with_self(q, self_logit, v, keys, values, valid, dropout) -> jax.Array:
    """One decode query's softmax over past ``keys``/``values`` ``[b, h, n, d]`` (``valid [b, h,
    n]``) and its own key (``self_logit [b, h, 1, 1]``, value ``v [b, h, 1, d]``); ``q [b, h, 1, d]``
    scaled by ``d ** -0.5``; ``dropout`` applied to the probabilities. Returns ``[b, h, 1, d]``."""
    past_logits = jnp.einsum("bhqd,bhkd->bhqk", q, keys.astype(q.dtype)).astype(jnp.float32)
    past_logits = past_logits + jnp.where(valid, 0.0, MASK_VALUE)[:, :, None, :].astype(jnp.float32)
    probs = jax.nn.softmax(jnp.concatenate([past_logits, self_logit], axis=-1), axis=-1)
    probs = dropout(probs).astype(v.dtype)
    past_values = jnp.einsum("bhqk,bhkd->bhqd", probs[..., :-1], values.astype(v.dtype))
    return past_values + probs[..., -1:] * v


class LSHSelfAttention(nn.Module, ConvolutionCacheMixin):
    """LSH self-attention, ``[batch, length, d_model] -> [batch, length, d_model]``.

    Injected-layer contract as ``CausalSelfAttention`` (constructed with ``d_model, n_heads,
    dropout_rate, dtype``; see the module docstring for the algorithm and decode).

    Attributes:
      d_head: per-head size (default ``d_model // n_heads``; the 'sparse' format needs that).
      chunk_len, n_chunks_before, n_chunks_after: sort-and-chunk geometry (128, 1, 0).
      n_hashes: hash rounds (2).
      n_buckets: buckets per round, an even int, a list of even factors (factorised hash),
        or ``None`` for ``2·max(1, L // chunk_len)`` (factorised above 128).
      causal: causal masking (decode needs it).
      dropout_rate: attention-probability dropout (the contract's argument).
      attention_dropout: if set, overrides ``dropout_rate`` (so a gin binding such as the
        reference's 0.2 wins over the model-wide value the model passes explicitly). The
        mask is shared across chunks, as the reference's. There is no output dropout: the
        residual dropout belongs to the calling block.
      use_bias: biases on the 'model' projections.
      weights_format: 'model' (fused Q/V ``Dense`` plus output ``Dense``) or 'sparse' (§2.5b:
        the multiplicative layer and Q, K, V convolutions of ``SparseQKVAttention`` with the
        same parameter names, Q and K averaged into the shared QK, no output projection, so
        a model trained with sparse-QKV full attention can be fine-tuned with LSH).
      attention_sparsity, length_kernel_size, module_kernel_size, value_module_kernel_size:
        the 'sparse' format's S, F and module kernels (as ``SparseQKVAttention``).
      std_length: if set, sequences (and decode caches) of at most this length use full
        shared-QK attention with the same masks (the reference's ``MixedLSHSelfAttention``;
        with a large value it is the dense reference path).
      hash_seed: seed of the fixed rotations used when no rng stream supplies them.
      decode_candidates: how a decode step finds its keys: 'buckets' (the default: from
        per-bucket position lists, O(n_keep) per step) or 'all' (ranking the whole cache,
        O(max_decode_length); the same keys, kept as the reference for tests).
      cache_dtype: how the decode key/value cache is stored (``terra.backends.decode_state``:
        'float32' as computed, 'bfloat16', or 'int8' with a float32 scale per row); a step
        widens only the rows it keeps.

    ``__call__(x, mask=None, *, deterministic=True, decode=False, max_decode_length=None,
    buckets=None, prefix_mask=None)``: ``mask`` ``[batch, length]`` (1 = real token) marks keys
    that are never attended to; ``buckets`` ``[batch, heads, n_hashes, length]`` replays a
    previous call's hashing (as sown in ``intermediates/buckets``); ``prefix_mask`` on the
    cache-creating decode call prefills the cache with a multi-token prefix (real tokens
    first), as ``CausalSelfAttention``'s.
    """

    d_model: int
    n_heads: int
    dropout_rate: float = 0.0
    d_head: Optional[int] = None
    chunk_len: int = 128
    n_chunks_before: int = 1
    n_chunks_after: int = 0
    n_hashes: int = 2
    n_buckets: NBuckets = None
    causal: bool = True
    attention_dropout: Optional[float] = None
    use_bias: bool = True
    weights_format: str = "model"
    attention_sparsity: Optional[int] = None
    length_kernel_size: int = 3
    module_kernel_size: int = 3
    value_module_kernel_size: int = 1
    std_length: Optional[int] = None
    hash_seed: int = 0
    decode_candidates: str = "buckets"
    cache_dtype: str = "float32"
    dtype: jnp.dtype = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def _dropout(self) -> float:
        return self.dropout_rate if self.attention_dropout is None else self.attention_dropout

    def _check(self, decode: bool) -> None:
        if self.weights_format not in WEIGHTS_FORMATS:
            raise ConfigError(f"LSHSelfAttention.weights_format={self.weights_format!r}; use one of {WEIGHTS_FORMATS}.")
        if self.weights_format == "sparse" and self.head_dim * self.n_heads != self.d_model:
            raise ConfigError(
                f"LSHSelfAttention: weights_format='sparse' needs d_head * n_heads == d_model, got "
                f"{self.head_dim} * {self.n_heads} != {self.d_model}."
            )
        if self.chunk_len <= 0 or self.n_chunks_before < 0 or self.n_chunks_after < 0 or self.n_hashes <= 0:
            raise ConfigError(
                f"LSHSelfAttention: chunk_len={self.chunk_len}, n_chunks_before={self.n_chunks_before}, "
                f"n_chunks_after={self.n_chunks_after}, n_hashes={self.n_hashes} must be positive (chunks >= 0)."
            )
        if self.decode_candidates not in DECODE_CANDIDATES:
            raise ConfigError(
                f"LSHSelfAttention.decode_candidates={self.decode_candidates!r}; use one of {DECODE_CANDIDATES}."
            )
        check_cache_dtype(self.cache_dtype)
        if decode and not self.causal:
            raise ConfigError(
                "LSHSelfAttention: decode needs causal=True (the reference supports only causal fast inference)."
            )
        if decode and self.n_chunks_after:
            raise ConfigError(
                f"LSHSelfAttention: decode needs n_chunks_after=0, got {self.n_chunks_after} (as the reference)."
            )

    # ----------------------------------------------------------------- projections
    def _project(self, x: jax.Array, decode: bool, prefix_mask=None) -> Tuple[jax.Array, jax.Array]:
        """``x`` -> head-major shared QK and values ``[batch, heads, length, d_head]``."""
        batch = x.shape[0]
        heads_first = lambda t: jnp.swapaxes(t.reshape(batch, -1, self.n_heads, self.head_dim), 1, 2)  # noqa: E731
        if self.weights_format == "model":
            y = Dense(
                (self.n_heads, 2, self.head_dim),
                kernel_axes=(axes.HEADS, axes.QKV, axes.KV, axes.EMBED),
                use_bias=self.use_bias,
                dtype=self.dtype,
                kernel_init=stacked_glorot_uniform(),
                name="qv",
            )(x)
            return heads_first(y[..., 0, :]), heads_first(y[..., 1, :])
        s = attention_sparsity_modules(self.d_model, self.n_heads, self.attention_sparsity, "LSHSelfAttention")
        m = self.d_model // s
        u = MultiplicativeDense(self.d_model, s, split_modules=True, dtype=self.dtype, name="mult")(x)
        window, causal_pad = self.conv_window(u, self.length_kernel_size, decode, prefix_mask)

        def conv(name, module_kernel):
            return ModuleConvolution(m, self.length_kernel_size, module_kernel, dtype=self.dtype, name=name)

        q_conv, k_conv = conv("q_conv", self.module_kernel_size), conv("k_conv", self.module_kernel_size)
        v = conv("v_conv", self.value_module_kernel_size)(window, causal_pad=causal_pad)
        stored = (q_conv.stored_weights(), k_conv.stored_weights())  # (kernel, bias) each; None before init
        if causal_pad and stored[0][0] is not None and stored[1][0] is not None:
            # The reference's QKAvg, (conv_q(u) + conv_k(u)) / 2, as one convolution with the
            # averaged weights (a convolution is linear in them): half the Q/K products of a
            # whole sequence (a prefill, training), the same parameters.
            half = jnp.asarray(0.5, self.dtype)
            kernel, bias = (half * (as_float(a, self.dtype) + as_float(b, self.dtype)) for a, b in zip(*stored))
            qk = convolve_modules(window, kernel, bias, self.dtype)
        else:
            q, k = q_conv(window, causal_pad=causal_pad), k_conv(window, causal_pad=causal_pad)
            qk = (q + k) * jnp.asarray(0.5, q.dtype)  # the reference's QKAvg
        return heads_first(qk), heads_first(v)

    def _output(self, y: jax.Array) -> jax.Array:
        """Head-major ``[batch, heads, length, d_head]`` -> ``[batch, length, d_model]``."""
        y = jnp.swapaxes(y, 1, 2)
        if self.weights_format == "sparse":
            return y.reshape(y.shape[0], y.shape[1], self.d_model)  # no output projection (§2.5b)
        return output_projection(y, d_model=self.d_model, use_bias=self.use_bias, dtype=self.dtype)

    # --------------------------------------------------------------------- hashing
    def _rotation_key(self, deterministic: bool) -> jax.Array:
        if self.has_rng("lsh"):
            return self.make_rng("lsh")
        if not deterministic and self.has_rng("dropout"):
            return self.make_rng("dropout")
        path = "/".join(str(p) for p in self.path)
        return jnp.asarray([self.hash_seed & 0xFFFFFFFF, zlib.crc32(path.encode())], jnp.uint32)

    # --------------------------------------------------------------------- forward
    def _sequence_hash(self, length: int) -> Tuple[int, Tuple[int, ...]]:
        """A whole sequence's length padded to whole chunks, and the bucket factors it hashes with."""
        padded = -(-length // self.chunk_len) * self.chunk_len
        return padded, bucket_factors(self.n_buckets, padded, self.chunk_len)

    def _forward(self, q, v, mask, buckets, deterministic: bool) -> jax.Array:
        batch, _, length, _ = q.shape
        key_mask = jnp.ones((batch, length), bool) if mask is None else mask.astype(bool)
        if self.std_length is not None and length <= self.std_length:
            return full_shared_qk_attention(q, v, key_mask, causal=self.causal)
        padded, factors = self._sequence_hash(length)
        n_real = math.prod(factors)  # id n_real is the padding bucket
        if buckets is None:
            key = self._rotation_key(deterministic)
            buckets = hash_vectors(q, draw_rotations(key, self.n_heads, self.head_dim, self.n_hashes, factors), factors)
        else:
            expected = (batch, self.n_heads, self.n_hashes, length)
            if tuple(buckets.shape) != expected:
                raise ValueError(f"LSHSelfAttention: buckets have shape {tuple(buckets.shape)}, expected {expected}.")
            buckets = jnp.clip(buckets.astype(jnp.int32), 0, n_real)
        buckets = lax.stop_gradient(jnp.where(key_mask[:, None, None, :], buckets, n_real))
        self.sow("intermediates", "buckets", buckets)
        pad = padded - length
        if pad:
            q, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in (q, v))
            key_mask = jnp.pad(key_mask, ((0, 0), (0, pad)))
            buckets = jnp.pad(buckets, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=n_real)
        dropout = None
        if self._dropout > 0.0 and not deterministic:
            layer = nn.Dropout(self._dropout, broadcast_dims=(2,))
            dropout = lambda p: layer(p, deterministic=False)  # noqa: E731
        y = lsh_attention(
            q,
            v,
            buckets,
            n_real + 1,
            key_mask,
            chunk_len=self.chunk_len,
            n_chunks_before=self.n_chunks_before,
            n_chunks_after=self.n_chunks_after,
            causal=self.causal,
            dropout=dropout,
        )
        return y[:, :, :length]

    # ---------------------------------------------------------------------- decode
    def _decode_step(self, q, v, mask, *, deterministic: bool, max_decode_length: Optional[int], prefix_mask=None):
        """Returns ``(output, prefix_buckets)``: the head-major output, or ``None`` on the
        cache-creating call (which, given ``prefix_mask``, also writes the prefix's keys, values,
        buckets and bucket lists: a prefill), and the prefix's buckets where the prefill's own
        attention hashes as the cache does (else ``None``). The layer's decode state is one
        :class:`LSHCache`."""
        if has_state(self, LSHCache):
            if q.shape[2] != 1:
                raise ValueError(
                    f"LSHSelfAttention decode step expects one token per call, got {q.shape[2]} positions."
                )
            y, cache = self._step(q, v, mask, get_state(self, LSHCache), deterministic)
            put_state(self, cache)
            return y, None
        if max_decode_length is None:
            raise ValueError("LSHSelfAttention: the cache-creating decode call needs max_decode_length.")
        cache, own_buckets = self._created_cache(q, v, max_decode_length, deterministic, prefix_mask)
        put_state(self, cache)
        return None, own_buckets

    def _decode_layout(self, max_len: int):
        """``(bucket factors, n_keep, bucket lists?)`` of a cache of ``max_len`` positions: the
        rows a step keeps per head, and whether it finds them in per-bucket lists (§4.2)."""
        factors = bucket_factors(self.n_buckets, max_len, self.chunk_len)
        n_keep = self.n_hashes * self.chunk_len * (1 + self.n_chunks_before) - 1
        if self.std_length is not None and max_len <= self.std_length:
            n_keep = max_len
        return factors, n_keep, self.decode_candidates == "buckets" and n_keep < max_len

    def _created_cache(self, q, v, max_len: int, deterministic: bool, prefix_mask):
        """The cache a cache-creating call makes (its rotations drawn now) and, given
        ``prefix_mask [batch, length]``, fills with the prefix: ``(cache, own_buckets)``."""
        batch, heads, length, d = q.shape
        factors, n_keep, use_lists = self._decode_layout(max_len)
        n_real = math.prod(factors)
        # Stored [heads, n_hashes, n_buckets / 2, d] for the step's product (hash_query).
        rotations = jnp.moveaxis(
            draw_rotations(self._rotation_key(deterministic), heads, d, self.n_hashes, factors), 1, -1
        )
        # Ring buffers of the latest n_keep positions per (round, bucket) and of the latest
        # n_keep real positions (select_from_bucket_lists says why n_keep slots suffice).
        lists = (n_real, n_keep) if use_lists else None
        cache = LSHCache.empty((batch, heads, max_len, d), self.n_hashes, rotations, self.cache_dtype, q.dtype, lists)
        if prefix_mask is None:
            return cache, None
        if length >= max_len:
            raise ValueError(
                f"LSHSelfAttention: a prefix of {length} positions leaves no room in a cache of {max_len}; "
                "raise max_decode_length."
            )
        real = prefix_mask.astype(bool)
        by_column = jnp.moveaxis(rotations, -1, 1)  # [heads, d, n_hashes, n_buckets / 2]
        prefix_buckets = jnp.where(real[:, None, None, :], hash_vectors(q, by_column, factors), -1)
        # Where the prefill's own attention hashes with the cache's rotations and factors: the
        # same buckets, hashed once.
        own_buckets = prefix_buckets if factors == self._sequence_hash(length)[1] else None
        cache = cache.with_rows(length_normalized(q), v, 0)
        changes = dict(
            buckets=lax.dynamic_update_slice(cache.buckets, prefix_buckets, (0, 0, 0, 0)),
            index=jnp.asarray(length, jnp.int32),
        )
        if use_lists:
            changes["bucket_positions"], changes["bucket_counts"] = latest_positions(prefix_buckets, n_real, n_keep)
            real_ids = jnp.where(real, 0, -1).astype(jnp.int32)
            changes["recent_positions"], changes["recent_counts"] = latest_positions(real_ids, 1, n_keep)
        return dataclasses.replace(cache, **changes), own_buckets

    def _step(self, q, v, mask, cache: LSHCache, deterministic: bool):
        """One token's attention over the keys it keeps, and the cache with the token written:
        ``(y [batch, heads, 1, d_head], cache)``."""
        batch, _, _, d = q.shape
        factors, n_keep, use_lists = self._decode_layout(cache.max_length)
        k = length_normalized(q)
        q_buckets = hash_query(q[:, :, 0], cache.rotations, factors)  # [b, h, n_hashes]
        if mask is not None:
            q_buckets = jnp.where(mask.astype(bool).reshape(batch, 1, 1), q_buckets, -1)
        scale = jnp.asarray(d**-0.5, q.dtype)
        q_scaled = q * scale
        self_logit = jnp.sum(q * k * scale, axis=-1, keepdims=True).astype(jnp.float32) + SELF_MASK_VALUE
        dropout = nn.Dropout(self._dropout)
        drop = lambda p: dropout(p, deterministic=deterministic)  # noqa: E731
        if use_lists:

            def from_lists(q_scaled, self_logit, v, q_buckets, cache):
                own_bucket = jnp.maximum(q_buckets, 0)[..., None, None]  # [b, h, n_hashes, 1, 1]
                own_lists = jnp.take_along_axis(cache.bucket_positions, own_bucket, axis=3)[..., 0, :]
                recent = cache.recent_positions[:, 0]
                kept = select_from_bucket_lists(own_lists, recent, cache.buckets, q_buckets, n_keep)
                return self._attend_rows(q_scaled, self_logit, v, cache, kept, kept >= 0, drop)

            if deterministic or self._dropout == 0.0:
                # A backend may choose the keys and read their rows in one call (terra.backends).
                y = lsh_bucket_attention(q_scaled, self_logit, v, q_buckets, cache, from_lists)
            else:
                y = from_lists(q_scaled, self_logit, v, q_buckets, cache)
        elif n_keep < cache.max_length:
            kept = select_from_whole_cache(cache.buckets, q_buckets, n_keep)
            y = self._attend_rows(q_scaled, self_logit, v, cache, kept, kept >= 0, drop)
        else:  # every past key is attended to; valid: written and not padding
            keys = widen_rows(cache.key, cache.key_scale, q.dtype)
            values = widen_rows(cache.value, cache.value_scale, v.dtype)
            y = attend_with_self(q_scaled, self_logit, v, keys, values, cache.buckets[:, :, 0, :] >= 0, drop)
        return y, self._written(cache, k, v, q_buckets, y)

    @staticmethod
    def _attend_rows(q_scaled, self_logit, v, cache: LSHCache, kept, valid, drop):
        """Attention over the cache rows ``kept [b, h, n]`` (only those widened) and the token's own."""
        keys = read_rows(cache.key, cache.key_scale, kept, q_scaled.dtype)
        values = read_rows(cache.value, cache.value_scale, kept, v.dtype)
        return attend_with_self(q_scaled, self_logit, v, keys, values, valid, drop)

    def _written(self, cache: LSHCache, k, v, q_buckets, y) -> LSHCache:
        """``cache`` with the token's key, value, buckets and list entries written at its index, after
        the step's reads (each write depends on ``y``, which depends on every read)."""
        index = cache.index
        cache = cache.with_rows(write_after_read(k, y, index), write_after_read(v, y, index), index)
        new_buckets = write_after_read(q_buckets, y, index)[..., None]
        changes = dict(buckets=lax.dynamic_update_slice(cache.buckets, new_buckets, (0, 0, 0, index)))
        if cache.has_lists:
            position = write_after_read(index, y, index)  # the lists are read before written
            changes["bucket_positions"], changes["bucket_counts"] = append_position(
                cache.bucket_positions, cache.bucket_counts, q_buckets, position
            )
            real_id = jnp.where(q_buckets[:, :1, 0] >= 0, 0, -1)  # [b, 1]; padded tokens join no list
            changes["recent_positions"], changes["recent_counts"] = append_position(
                cache.recent_positions, cache.recent_counts, real_id, position
            )
        changes["index"] = index + 1
        return dataclasses.replace(cache, **changes)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: Optional[jax.Array] = None,
        *,
        deterministic: bool = True,
        decode: bool = False,
        max_decode_length: Optional[int] = None,
        buckets: Optional[jax.Array] = None,
        prefix_mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        self._check(decode)
        q, v = self._project(x, decode, prefix_mask if decode else None)
        y = None
        if decode:
            y, prefix_buckets = self._decode_step(
                q, v, mask, deterministic=deterministic, max_decode_length=max_decode_length, prefix_mask=prefix_mask
            )
            if buckets is None:
                buckets = prefix_buckets
            if prefix_mask is not None:
                mask = prefix_mask  # the prefill's own output: padded keys never attended to
        if y is None:
            y = self._forward(q, v, mask, buckets, deterministic)
        return self._output(y)
