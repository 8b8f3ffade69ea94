"""Dense multi-head attention: encoder self-attention, decoder causal self-attention with a
KV cache, and encoder-decoder attention whose keys and values are computed once and cached.

Decode caches are stored head-major, ``[batch, heads, length, d_head]``, so the per-step
``q · K^T`` and ``p · V`` are batched over (batch, heads) with contiguous rows and XLA:CPU
never transposes the cache inside the step (``docs/design/cpu_decoding.md``). Cache variables are
created on the first decode call, guarded with ``has_variable``: ``init``/prefill *runs*
the body, so an unguarded index update would advance on creation
(``docs/design/jax_stack.md``, pitfall 7). Each attention layer keeps one cache entry, a
:class:`~terra.backends.decode_state.KVCache` (``terra/backends/decode_state.py``).

``cache_dtype`` stores the decode caches narrow: bfloat16, or int8 with one float32 scale per
(batch, head, position), ``[batch, heads, length]``, beside the caches. A decode step reads them narrow
(``backends.cache_attention``: on the CPU one native call that widens each row in registers);
float32 leaves the caches as before.
"""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import (  # noqa: F401  (attention_in_query_chunks: the XLA form, re-exported)
    MASK_VALUE,
    KVCache,
    attention_in_query_chunks,
    blocked_attention,
    cache_attention,
    cache_logits,
    cache_weighted_values,
    cached_attention,
    get_state,
    has_state,
    put_state,
)
from terra.layers import axes
from terra.layers.dense import Dense
from terra.layers.initializers import stacked_glorot_uniform


def padding_bias(key_mask: jax.Array) -> jax.Array:
    """``[batch, kv_length]`` bool/int mask -> additive bias ``[batch, 1, 1, kv_length]``."""
    return jnp.where(key_mask.astype(bool), 0.0, MASK_VALUE)[:, None, None, :].astype(jnp.float32)


def causal_bias(length: int) -> jax.Array:
    """``[1, 1, length, length]`` additive bias that hides future positions."""
    idx = jnp.arange(length)
    return jnp.where(idx[:, None] >= idx[None, :], 0.0, MASK_VALUE)[None, None].astype(jnp.float32)


def output_projection(y: jax.Array, *, d_model: int, use_bias: bool, dtype) -> jax.Array:
    """The heads' output projection ``[batch, length, heads, d_head] -> [batch, length, d_model]``,
    created as the submodule ``out`` of the calling (compact) attention module."""
    return Dense(
        d_model,
        kernel_axes=(axes.EMBED, axes.HEADS, axes.KV),
        n_contract=2,
        use_bias=use_bias,
        dtype=dtype,
        name="out",
    )(y)


class AttentionBase(nn.Module):
    """Shared sizes, projections and the softmax core.

    Injected-layer contract: constructed with ``d_model, n_heads, dropout_rate, dtype``.
    ``dropout_rate`` is the attention (probability) dropout; the residual-branch dropout
    belongs to the block that calls the layer.
    """

    d_model: int
    n_heads: int
    dropout_rate: float = 0.0
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    query_chunk_size: int = 512
    # How the decode caches are stored (decode_state.CACHE_DTYPES); models set it on decoder attentions.
    cache_dtype: str = "float32"

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def _project(self, x: jax.Array, n_stack: int, name: str) -> jax.Array:
        """``[batch, length, d_model] -> [n_stack, batch, length, heads, d_head]``.

        Several projections of the same input (Q, K, V) are fused into one kernel so the
        decode step reads them with one matrix-vector product. The kernel is heads-major,
        ``[heads, n_stack, d_head, d_model]``, so sharding heads splits it in contiguous blocks.
        """
        if n_stack == 1:
            y = Dense(
                (self.n_heads, self.d_head),
                kernel_axes=(axes.HEADS, axes.KV, axes.EMBED),
                use_bias=self.use_bias,
                dtype=self.dtype,
                name=name,
            )(x)
            return y[None]
        y = Dense(
            (self.n_heads, n_stack, self.d_head),
            kernel_axes=(axes.HEADS, axes.QKV, axes.KV, axes.EMBED),
            use_bias=self.use_bias,
            dtype=self.dtype,
            kernel_init=stacked_glorot_uniform(),
            name=name,
        )(x)
        return jnp.moveaxis(y, 3, 0)

    def _output(self, y: jax.Array) -> jax.Array:
        """``[batch, length, heads, d_head] -> [batch, length, d_model]``."""
        return output_projection(y, d_model=self.d_model, use_bias=self.use_bias, dtype=self.dtype)

    def _attend(
        self, q, k, v, bias, deterministic: bool, *, causal: bool = False, key_scale=None, value_scale=None
    ) -> jax.Array:
        """Head-major core: q ``[b, h, lq, d]``, k/v ``[b, h, lk, d]``, bias broadcastable to
        ``[b, h, lq, lk]`` -> ``[b, h, lq, d]``; ``causal`` (lq == lk) also hides later keys.

        Without dropout and with a bias that does not vary over queries (``[b|1, 1, 1, lk]``),
        more than ``query_chunk_size`` queries never hold the ``[heads, lq, lk]`` scores whole
        (14 GB at 16 heads and 15,360 positions in float32): deterministic (a prefill, an
        evaluation), by ``backends.blocked_attention`` (on the CPU one native call, blocks of
        queries against tiles of keys); otherwise (training without dropout) one chunk of queries
        at a time (``attention_in_query_chunks``), which the blocked form differentiates too.

        k and v may be a decode cache stored narrow (int8 with ``key_scale``/``value_scale
        [b, h, lk]``, or bfloat16): the backend reads them narrow (one query in decoding)."""
        query_invariant = bias.ndim < 4 or bias.shape[2] == 1
        stored_as_q = key_scale is None and k.dtype == q.dtype
        if (
            (deterministic or self.dropout_rate == 0.0)
            and query_invariant
            and stored_as_q
            and q.shape[2] > self.query_chunk_size
        ):
            if deterministic:
                return blocked_attention(q, k, v, bias, causal=causal, chunk=self.query_chunk_size)
            return attention_in_query_chunks(q, k, v, bias, causal=causal, chunk=self.query_chunk_size)
        scale = jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        if q.shape[2] == 1 and not causal and bias.ndim == 4 and bias.shape[1] == bias.shape[2] == 1:
            # One query per head (a decode step's cross-attention): the backend's read of the
            # cache, which on the CPU widens each row of a narrow cache in registers.
            keys_bias = jnp.broadcast_to(bias.reshape(bias.shape[0], -1), (q.shape[0], k.shape[2]))
            y = cache_attention(
                q * scale,
                k,
                v,
                keys_bias,
                key_scale,
                value_scale,
                dropout=self._probability_dropout(deterministic),
            )
            return y.astype(q.dtype)
        if causal:
            bias = bias + causal_bias(q.shape[2])
        q = q * scale
        logits = cache_logits(q, k, key_scale) + bias
        probs = jax.nn.softmax(logits, axis=-1)
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
        return cache_weighted_values(probs.astype(q.dtype), v, value_scale).astype(q.dtype)

    def _probability_dropout(self, deterministic: bool):
        """The dropout on attention probabilities, or ``None`` where it does nothing (so that the
        backends may read a decode cache with their own kernels)."""
        if deterministic or self.dropout_rate == 0.0:
            return None
        return lambda probs: nn.Dropout(self.dropout_rate)(probs, deterministic=False)

    def _causal_attend(
        self,
        q,
        k,
        v,
        *,
        deterministic: bool,
        decode: bool,
        max_decode_length: Optional[int],
        prefix_mask: Optional[jax.Array] = None,
    ):
        """Causal attention over head-major ``[batch, heads, length, d_head]`` q, k, v.

        In decode mode the keys and values of past tokens are this layer's :class:`KVCache`
        (its one decode-state entry, ``[batch, heads, max_decode_length, d_head]`` with its
        write position); the first (cache-creating) call only creates it. Later calls take one
        token.

        Prefill: a cache-creating call given ``prefix_mask`` ``[batch, length]`` (1 = real
        token) instead *writes* its ``length`` positions into cache slots ``[0, length)``,
        records which are real in the cache's ``key_mask`` (padded slots are never attended to)
        and continues at position ``length``. Terraformer uses this for the encoder prefix of its
        concatenated decoder sequence.
        """
        no_bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
        if not decode:
            return self._attend(q, k, v, no_bias, deterministic, causal=True)
        if has_state(self, KVCache):
            if q.shape[2] != 1:
                raise ValueError(
                    f"{type(self).__name__} decode step expects one token per call, got {q.shape[2]} positions."
                )
            dropout = self._probability_dropout(deterministic)
            y, cache = cached_attention(q, k, v, get_state(self, KVCache), dropout=dropout)
            put_state(self, cache)
            return y
        if max_decode_length is None:
            raise ValueError(f"{type(self).__name__}: the cache-creating decode call needs max_decode_length.")
        cache = KVCache.empty((q.shape[0], k.shape[1], max_decode_length, k.shape[3]), self.cache_dtype, k.dtype)
        bias = no_bias
        if prefix_mask is not None:
            if q.shape[2] >= max_decode_length:
                raise ValueError(
                    f"{type(self).__name__}: a prefix of {q.shape[2]} positions leaves no room in a cache of "
                    f"{max_decode_length}; raise max_decode_length."
                )
            bias = padding_bias(prefix_mask.astype(bool))
            cache = cache.prefilled(k, v, prefix_mask, self.cache_dtype)
        put_state(self, cache)
        return self._attend(q, k, v, bias, deterministic, causal=True)

    def _encoder_keys_values(self, encoded, encoder_mask, *, decode: bool) -> KVCache:
        """The encoder output's head-major keys and values ``[batch, heads, kv_length, d_head]``
        with its padding ``bias`` as a :class:`KVCache`; in decode mode computed once, stored as
        ``cache_dtype`` says (the layer's decode-state entry), and then read from the cache (the
        creating call already returns them as stored)."""
        if decode and has_state(self, KVCache):
            return get_state(self, KVCache)
        if encoded is None or encoder_mask is None:
            raise ValueError(f"{type(self).__name__} needs the encoder output and mask on its first call.")
        keys, values = (self._heads_first(t) for t in self._project(encoded, 2, "kv"))
        bias = padding_bias(encoder_mask)
        if not decode:
            return KVCache(keys, None, values, None, bias=bias)
        cache = KVCache.of(keys, values, self.cache_dtype, bias=bias)
        put_state(self, cache)
        return cache

    def _attend_encoder(self, q, cache: KVCache, deterministic: bool) -> jax.Array:
        """``q [b, h, lq, d]`` attended over the encoder's keys and values ``cache``."""
        scales = {"key_scale": cache.key_scale, "value_scale": cache.value_scale}
        return self._attend(q, cache.key, cache.value, cache.bias, deterministic, **scales)

    @staticmethod
    def params_read_per_token(params, batch: int = 1) -> int:
        """Parameters one decoded token reads (encoder keys/values are cached, not read); the
        same for a step of any ``batch``: attention selects no weights per sequence."""
        return sum(x.size for name, sub in params.items() if name != "kv" for x in jax.tree.leaves(sub))

    @staticmethod
    def _heads_first(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x, 1, 2)  # [b, l, h, d] <-> [b, h, l, d]


class SelfAttention(AttentionBase):
    """Bidirectional self-attention with a key padding mask (the encoder's attention).

    ``x``: ``[batch, length, d_model]``; ``mask``: ``[batch, length]`` (1 = real token).
    """

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool = True) -> jax.Array:
        q, k, v = (self._heads_first(t) for t in self._project(x, 3, "qkv"))
        y = self._attend(q, k, v, padding_bias(mask), deterministic)
        return self._output(self._heads_first(y))


class CausalSelfAttention(AttentionBase):
    """Decoder self-attention; each position sees itself and the past.

    Full mode: ``x`` ``[batch, length, d_model]`` with a causal mask.
    Decode mode: ``x`` ``[batch, 1, d_model]``; keys and values of past tokens live in the
    ``cache`` collection (see ``_causal_attend``). The first decode call creates the cache
    (its output is discarded by the caller), or, given ``prefix_mask``, prefills it with a
    multi-token prefix (see ``_causal_attend``).
    """

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        max_decode_length: Optional[int] = None,
        prefix_mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        q, k, v = (self._heads_first(t) for t in self._project(x, 3, "qkv"))
        y = self._causal_attend(
            q,
            k,
            v,
            deterministic=deterministic,
            decode=decode,
            max_decode_length=max_decode_length,
            prefix_mask=prefix_mask,
        )
        return self._output(self._heads_first(y))


class CrossAttention(AttentionBase):
    """Encoder-decoder attention: queries from the decoder, keys/values from the encoder.

    ``x``: ``[batch, length, d_model]``; ``encoded``: ``[batch, kv_length, d_model]``;
    ``encoder_mask``: ``[batch, kv_length]``. In decode mode the keys, values and mask are
    computed once, on the cache-creating call, and later calls read them from the cache
    (``encoded`` and ``encoder_mask`` may then be ``None``): per token only the query and
    output projections are read, as the paper's §1 counts.
    """

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        encoded: Optional[jax.Array],
        encoder_mask: Optional[jax.Array],
        *,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        q = self._heads_first(self._project(x, 1, "q")[0])
        y = self._attend_encoder(q, self._encoder_keys_values(encoded, encoder_mask, decode=decode), deterministic)
        return self._output(self._heads_first(y))
