"""Which past keys an LSH decode step keeps (``docs/design/reference_code.md`` §4.5: those sharing
the query's bucket in any hash round first, then the latest): the reference's rule over the whole
cache (``select_from_whole_cache``), the same choice from per-bucket lists of positions
(``select_from_bucket_lists``), and those lists as ring buffers, filled at once by a prefill
(``latest_positions``) or one position per step (``append_position``). The layer's decode step
and the memory the lists take are described in ``terra/layers/lsh_attention.py``.
"""

import math
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax

from terra.layers.lsh_chunked_attention import stable_order


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
    # float32 top_k is its fast path, far faster than int32's (docs/architecture.md).
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
    # Cheaper on XLA:CPU than lax.top_k over the candidates (docs/architecture.md, "LSH decode
    # from bucket lists"), and the kept order does not matter.
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
