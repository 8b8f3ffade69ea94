"""Decode state: what each layer keeps between decode steps, as typed structures, and how keys and
values are stored narrow (the sibling of ``weights_dtype``, ``terra.quantization``).

Each layer holds one entry per type below, a Flax variable of the ``cache`` collection named by the
type's ``NAME`` (``has_state``/``get_state``/``put_state``): :class:`KVCache` (a dense or
sparse-QKV attention's keys and values, their int8 scales, and the write position and visible-key
mask of a self-attention or the encoder's padding bias of a cross-attention; it narrows a new row
once, :meth:`KVCache.written`), :class:`LSHCache` (an LSH attention's keys, values, buckets,
rotations and bucket lists), :class:`ConvolutionRows`, :class:`DecodePosition` and
:class:`RecurrentState`. The backends' decode primitives take and return them.

At long inputs a decode step reads its attention caches (the decoder's self-attention cache and the
cross-attention's encoder keys/values) more than its weights, so their bytes set the step time.
``cache_dtype`` stores them as:

- ``float32``: unchanged (the default; the cache pytree is exactly as before).
- ``bfloat16``: the values rounded to bfloat16, no scale (relative error <= 2^-9 per element), kept
  as their 16 bits in a ``uint16`` array, as the weights' bfloat16 store keeps them
  (``terra/quantization/quantized.py``): XLA:CPU slices and widens a ``bfloat16`` array through a
  float32 copy of all of it, several times float32's step, while ``bitcast(uint32(bits) << 16)``
  widens the bits exactly inside the fused loop, as fast as float32 (docs/architecture.md, "Narrow
  caches").
- ``int8``: symmetric int8 with one float32 scale per row of ``d_head`` values (per batch, head and
  position): ``scale = max|row| / 127`` (1 for an all-zero row), ``values = round(row / scale)``;
  the error per element is at most ``scale / 2 = max|row| / 254``.

Plain jax (no flax, no gin), below the layers and the backends, so both use it. A per-position scale factors out
of the attention products, so a step never widens a whole cache: ``q . (s_k K_k) = s_k (q . K_k)``
scales the ``[..., max_len]`` logits and ``sum_k p_k s_k V_k = (p * s) . V`` the probabilities
(``terra.backends.cache_attention``; on the CPU each row is widened in registers as it is read).
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from terra.errors import ConfigError
from terra.quantization.quantized import quantize

CACHE_DTYPES = ("float32", "bfloat16", "int8")


def check_cache_dtype(name: str) -> str:
    """``name`` if it names a cache store, else a :class:`ConfigError` listing them."""
    if name not in CACHE_DTYPES:
        raise ConfigError(
            f"cache_dtype '{name}' is not one of {', '.join(CACHE_DTYPES)} "
            "(bfloat16 and int8 store the attention caches narrow for decoding)."
        )
    return name


def storage_dtype(cache_dtype: str, dtype=jnp.float32):
    """The array dtype a cache of ``cache_dtype`` holds its values in: ``dtype`` (the compute
    dtype) for float32, ``uint16`` (bfloat16 bits) for bfloat16, ``int8``."""
    check_cache_dtype(cache_dtype)
    return {"float32": dtype, "bfloat16": jnp.uint16, "int8": jnp.int8}[cache_dtype]


def narrow_rows(x: jax.Array, cache_dtype: str) -> tuple[jax.Array, Optional[jax.Array]]:
    """``x [..., d]`` (float) as a cache stores it: the weights' narrow stores
    (:func:`terra.quantization.quantized.quantize`), one int8 scale per row.

    Returns:
      ``(values, scales)``: ``values [..., d]`` as the cache stores them (``x`` unchanged for
      float32, ``uint16`` bfloat16 bits, int8); ``scales [...]`` float32 (``max|row| / 127``, 1 for
      an all-zero row) for int8, ``None`` otherwise.
    """
    if check_cache_dtype(cache_dtype) == "float32":
        return x, None
    stored = quantize(x, cache_dtype)
    return stored.values, (stored.scale if cache_dtype == "int8" else None)


def stored_like(values: jax.Array, scales: Optional[jax.Array], x: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
    """``x [..., d]`` (float) as a cache whose arrays are ``values`` (and int8's ``scales``, else
    ``None``) stores it: ``(values, scales or None)``. The store is read off the arrays."""
    if scales is not None:
        return narrow_rows(x, "int8")
    if values.dtype == jnp.uint16:
        return narrow_rows(x, "bfloat16")
    return x.astype(values.dtype), None


def widen_rows(values: jax.Array, scales: Optional[jax.Array], dtype=jnp.float32) -> jax.Array:
    """``values [..., d]`` (and ``scales [...]`` for int8, else ``None``) back to ``dtype [..., d]``.

    Widens the whole array: for prefill and small caches; a decode step's products apply the scale
    to their logits and probabilities instead (``terra.backends.primitives``). ``uint16`` values
    are bfloat16 bits.
    """
    if values.dtype == jnp.uint16:
        values = jax.lax.bitcast_convert_type(values.astype(jnp.uint32) << 16, jnp.float32)
    x = values.astype(dtype)
    if scales is not None:
        x = x * scales[..., None].astype(dtype)
    return x


def empty_rows(shape, cache_dtype: str, dtype=jnp.float32) -> tuple[jax.Array, Optional[jax.Array]]:
    """A cache of ``shape [..., d]`` before anything is written: ``(values, scales)`` with values
    zeros in the cache's storage dtype (:func:`storage_dtype`; ``dtype`` for float32) and scales
    ``ones [...]`` float32 for int8, ``None`` otherwise."""
    values = jnp.zeros(shape, storage_dtype(cache_dtype, dtype))
    scales = jnp.ones(tuple(shape)[:-1], jnp.float32) if cache_dtype == "int8" else None
    return values, scales


# The Flax collection decode state lives in (``mutable=["cache"]``), each layer's entry a variable
# named by its type's ``NAME``.
COLLECTION = "cache"


def has_state(module, kind) -> bool:
    """Whether the Flax ``module`` holds its decode state of type ``kind`` (created by an earlier
    decode call)."""
    return module.has_variable(COLLECTION, kind.NAME)


def get_state(module, kind):
    """The Flax ``module``'s decode state of type ``kind`` (``has_state`` first)."""
    return module.get_variable(COLLECTION, kind.NAME)


def put_state(module, state) -> None:
    """Stores ``state`` as the Flax ``module``'s decode state of its type (creating it on a
    cache-creating call)."""
    module.put_variable(COLLECTION, type(state).NAME, state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One attention layer's keys and values as its decode steps read them.

    Fields (``None`` where the layer keeps no such array; ``None`` leaves nothing in the pytree):
      key, value: ``[batch, heads, length, d_head]`` in :func:`storage_dtype` of the layer's
        ``cache_dtype``.
      key_scale, value_scale: float32 ``[batch, heads, length]`` for an int8 cache.
      index: int32 ``[]``, a self-attention's next write position (positions before it are
        written); ``None`` for a cross-attention, whose keys are all written at creation.
      key_mask: bool ``[batch, length]``, a self-attention prefilled with a padded prefix: which
        written positions are real tokens.
      bias: float32 ``[batch, 1, 1, length]``, a cross-attention's additive padding bias of the
        encoder output.
    """

    NAME = "kv"

    # The field order is the pytree's leaf order: the order of the compiled decode programs'
    # arguments and of every sum over the cache's leaves (each array before its scale).
    key: jax.Array
    key_scale: Optional[jax.Array]
    value: jax.Array
    value_scale: Optional[jax.Array]
    index: Optional[jax.Array] = None
    key_mask: Optional[jax.Array] = None
    bias: Optional[jax.Array] = None

    @classmethod
    def empty(cls, shape, cache_dtype: str, dtype=jnp.float32) -> "KVCache":
        """A self-attention's cache of ``shape [batch, heads, length, d_head]`` before anything is
        written: zeros in the storage dtype, int8 scales of one, write position 0."""
        key, key_scale = empty_rows(shape, cache_dtype, dtype)
        value, value_scale = empty_rows(shape, cache_dtype, dtype)
        return cls(key, key_scale, value, value_scale, index=jnp.zeros((), jnp.int32))

    @classmethod
    def of(cls, keys: jax.Array, values: jax.Array, cache_dtype: str, **rest) -> "KVCache":
        """``keys``, ``values`` ``[batch, heads, length, d_head]`` (float) stored as ``cache_dtype``
        says, with the other fields from ``rest`` (a cross-attention's ``bias``)."""
        (key, key_scale), (value, value_scale) = narrow_rows(keys, cache_dtype), narrow_rows(values, cache_dtype)
        return cls(key, key_scale, value, value_scale, **rest)

    @property
    def max_length(self) -> int:
        return self.key.shape[2]

    def prefilled(self, keys: jax.Array, values: jax.Array, prefix_mask: jax.Array, cache_dtype: str) -> "KVCache":
        """This empty cache with a prefix's ``keys``, ``values`` ``[batch, heads, length, d_head]``
        written at positions ``[0, length)``, ``prefix_mask [batch, length]`` (1 = real token)
        recorded in ``key_mask`` and the write position at ``length``."""
        written = KVCache.of(keys, values, cache_dtype)
        stored = [
            None if old is None else lax.dynamic_update_slice(old, new, (0,) * old.ndim)
            for old, new in (
                (self.key, written.key),
                (self.key_scale, written.key_scale),
                (self.value, written.value),
                (self.value_scale, written.value_scale),
            )
        ]
        length = keys.shape[2]
        key_mask = jnp.ones((keys.shape[0], self.max_length), bool).at[:, :length].set(prefix_mask.astype(bool))
        return KVCache(*stored, index=jnp.asarray(length, jnp.int32), key_mask=key_mask)

    def written(self, k: jax.Array, v: jax.Array, after: jax.Array) -> "KVCache":
        """This cache with one position's ``k``, ``v`` ``[batch, heads, 1, d_head]`` (float) stored
        narrow at ``index`` and the write position advanced.

        ``after``: a value computed from this cache's read. The write is made data-dependent on it
        (:func:`write_after_read`), so XLA schedules the read before the in-place write: otherwise
        XLA:CPU copies a donated buffer that is both read and updated in one step (two full copies
        of every cache per layer per token; docs/architecture.md)."""
        index = self.index
        (k, new_key_scale), (v, new_value_scale) = (stored_like(self.key, self.key_scale, t) for t in (k, v))
        key = lax.dynamic_update_slice(self.key, write_after_read(k, after, index), (0, 0, index, 0))
        value = lax.dynamic_update_slice(self.value, write_after_read(v, after, index), (0, 0, index, 0))
        key_scale, value_scale = self.key_scale, self.value_scale
        if key_scale is not None:
            key_scale, value_scale = (
                lax.dynamic_update_slice(old, write_after_read(new, after, index), (0, 0, index))
                for old, new in ((key_scale, new_key_scale), (value_scale, new_value_scale))
            )
        return dataclasses.replace(
            self, key=key, value=value, key_scale=key_scale, value_scale=value_scale, index=index + 1
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LSHCache:
    """An LSH self-attention layer's decode state (paper §4.2, ``terra/layers/lsh_attention.py``).

    Fields (``None`` where the layer keeps no such array):
      bucket_counts, bucket_positions: with bucket lists only, per (round, bucket) ring buffers of
        the latest positions ``[batch, heads, n_hashes, n_buckets, n_keep]`` and how many were
        ever written ``[batch, heads, n_hashes, n_buckets]``.
      index: int32 ``[]``, the next write position.
      buckets: int32 ``[batch, heads, n_hashes, length]``, every written position's bucket per
        round (-1: not written, or padding).
      key, value: ``[batch, heads, length, d_head]`` as ``cache_dtype`` stores them (the keys
        are the length-normalised queries: LSH shares Q and K), with int8's ``key_scale``,
        ``value_scale`` ``[batch, heads, length]``.
      recent_counts, recent_positions: with bucket lists only, the ring buffer of the latest real
        positions ``[batch, 1, n_keep]`` and its count ``[batch, 1]``.
      rotations: float ``[heads, n_hashes, n_buckets / 2, d_head]``, the random rotations a token
        is hashed with, drawn once when the cache is created.
    """

    NAME = "lsh"

    # The field order is the pytree's leaf order (see KVCache).
    bucket_counts: Optional[jax.Array]
    bucket_positions: Optional[jax.Array]
    index: jax.Array
    buckets: jax.Array
    key: jax.Array
    key_scale: Optional[jax.Array]
    value: jax.Array
    value_scale: Optional[jax.Array]
    recent_counts: Optional[jax.Array]
    recent_positions: Optional[jax.Array]
    rotations: jax.Array

    @classmethod
    def empty(cls, shape, n_hashes: int, rotations: jax.Array, cache_dtype: str, dtype, lists=None) -> "LSHCache":
        """A cache of ``shape [batch, heads, length, d_head]`` before anything is written, hashing
        with ``rotations``; ``lists = (n_buckets, n_keep)`` keeps bucket lists of ``n_keep``
        positions (else ``None``)."""
        batch, heads, length, _ = shape
        key, key_scale = empty_rows(shape, cache_dtype, dtype)
        value, value_scale = empty_rows(shape, cache_dtype, dtype)
        bucket_counts = bucket_positions = recent_counts = recent_positions = None
        if lists is not None:
            n_buckets, n_keep = lists
            per_bucket = (batch, heads, n_hashes, n_buckets)
            bucket_counts = jnp.zeros(per_bucket, jnp.int32)
            bucket_positions = jnp.full(per_bucket + (n_keep,), -1, jnp.int32)
            recent_counts = jnp.zeros((batch, 1), jnp.int32)
            recent_positions = jnp.full((batch, 1, n_keep), -1, jnp.int32)
        return cls(
            bucket_counts=bucket_counts,
            bucket_positions=bucket_positions,
            index=jnp.zeros((), jnp.int32),
            buckets=jnp.full((batch, heads, n_hashes, length), -1, jnp.int32),
            key=key,
            key_scale=key_scale,
            value=value,
            value_scale=value_scale,
            recent_counts=recent_counts,
            recent_positions=recent_positions,
            rotations=rotations,
        )

    @property
    def max_length(self) -> int:
        return self.key.shape[2]

    @property
    def has_lists(self) -> bool:
        return self.bucket_positions is not None

    def with_rows(self, keys: jax.Array, values: jax.Array, index) -> "LSHCache":
        """This cache with ``keys``, ``values`` ``[batch, heads, n, d_head]`` (float) stored at
        positions ``index .. index + n - 1``, as the cache stores them."""
        key, key_scale = _written_rows(self.key, self.key_scale, keys, index)
        value, value_scale = _written_rows(self.value, self.value_scale, values, index)
        return dataclasses.replace(self, key=key, key_scale=key_scale, value=value, value_scale=value_scale)


def _written_rows(cache: jax.Array, scales: Optional[jax.Array], x: jax.Array, index):
    """``x [batch, heads, n, d]`` stored as ``cache`` (and ``scales``) store it and written into
    them at positions ``index ..``: ``(cache, scales)``."""
    values, new_scales = stored_like(cache, scales, x)
    if cache.dtype == jnp.bfloat16:
        # Written as its bits: XLA:CPU widens a bfloat16 dynamic-update-slice to float32 over the
        # whole cache (a pass over every position per step); uint16 is written in place.
        as_bits = lambda t: lax.bitcast_convert_type(t, jnp.uint16)  # noqa: E731
        bits = lax.dynamic_update_slice(as_bits(cache), as_bits(values), (0, 0, index, 0))
        cache = lax.bitcast_convert_type(bits, jnp.bfloat16)
    else:
        cache = lax.dynamic_update_slice(cache, values, (0, 0, index, 0))
    if scales is not None:
        scales = lax.dynamic_update_slice(scales, new_scales, (0, 0, index))
    return cache, scales


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvolutionRows:
    """A causal convolution's window kept between decode steps (a sparse QKV or LSH layer's
    multiplicative output, paper §2.2): ``rows [batch, F - 1, S, M]``, the last ``F - 1`` positions'
    rows, zeros before the first."""

    NAME = "conv_rows"
    rows: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodePosition:
    """A positional embedding's next position: ``index`` int32 ``[]``."""

    NAME = "position"
    index: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """An SRU's carried state ``carry [batch, units]`` float32 (paper §4.3)."""

    NAME = "carry"
    carry: jax.Array


def write_after_read(update: jax.Array, read: jax.Array, index: jax.Array) -> jax.Array:
    """``update`` unchanged, but data-dependent on ``read`` so XLA schedules the cache read
    before the in-place cache write. The added term is selected by a predicate that is
    false at run time but unknown at compile time, so it is exactly 0 (NaN-safe)."""
    dependency = jnp.where(index < 0, jnp.sum(read), 0.0)
    return update + dependency.astype(update.dtype)
