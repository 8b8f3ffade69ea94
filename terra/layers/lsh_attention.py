"""LSH (locality-sensitive hashing) self-attention, the Reformer attention that the
Terraformer uses for long sequences (paper §4; reference ``efficient_attention.py:
LSHSelfAttention``, ``docs/design/reference_code.md`` §4.5 and, for the sparse projections, §2.5b).

This module is the layer; its parts are modules beside it: ``lsh_hashing`` (bucket factors,
rotations, the hash), ``lsh_chunked_attention`` (sort, chunk, attend, unsort, combine the rounds),
``lsh_bucket_lists`` (which past keys a decode step keeps, and the per-bucket position lists) and
``lsh_decode_attention`` (a decode step's attention over the cache rows it keeps).

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
import math
import zlib
from typing import Optional, Tuple

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
    put_state,
    widen_rows,
    write_after_read,
)
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.attention import output_projection
from terra.layers.dense import Dense
from terra.layers.initializers import stacked_glorot_uniform
from terra.layers.lsh_bucket_lists import (
    append_position,
    latest_positions,
    select_from_bucket_lists,
    select_from_whole_cache,
)
from terra.layers.lsh_chunked_attention import (
    SELF_MASK_VALUE,
    full_shared_qk_attention,
    length_normalized,
    lsh_attention,
)
from terra.layers.lsh_decode_attention import attend_with_self, read_rows
from terra.layers.lsh_hashing import NBuckets, bucket_factors, draw_rotations, hash_query, hash_vectors
from terra.layers.multiplicative import MultiplicativeDense
from terra.layers.sparse_qkv import (
    ConvolutionCacheMixin,
    ModuleConvolution,
    attention_sparsity_modules,
    convolve_modules,
)

WEIGHTS_FORMATS = ("model", "sparse")
DECODE_CANDIDATES = ("buckets", "all")


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
        factors, n_keep, _ = self._decode_layout(cache.max_length)  # the lists: the cache has them or not
        k = length_normalized(q)
        q_buckets = hash_query(q[:, :, 0], cache.rotations, factors)  # [b, h, n_hashes]
        if mask is not None:
            q_buckets = jnp.where(mask.astype(bool).reshape(batch, 1, 1), q_buckets, -1)
        scale = jnp.asarray(d**-0.5, q.dtype)
        q_scaled = q * scale
        self_logit = jnp.sum(q * k * scale, axis=-1, keepdims=True).astype(jnp.float32) + SELF_MASK_VALUE
        dropout = nn.Dropout(self._dropout)
        drop = lambda p: dropout(p, deterministic=deterministic)  # noqa: E731
        if cache.has_lists:

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
