"""LSH attention's angular hash (the Reformer's; ``docs/design/reference_code.md`` §4.5): the bucket
factors a sequence length gets, the random rotations and the key they are drawn with, and the
buckets of a whole sequence (``hash_vectors``) or of one decode position (``hash_query``). The
layer that uses them, and where its rotations come from, is ``terra/layers/lsh_attention.py``.
"""

import math
from typing import Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from terra.backends import lsh_hash
from terra.errors import ConfigError
from terra.layers.selection import block_argmax

# Above this many buckets the automatic choice factorises the hash (as the reference).
MAX_UNFACTORED_BUCKETS = 128

NBuckets = Union[int, Sequence[int], None]


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
