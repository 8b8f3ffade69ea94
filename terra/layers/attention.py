"""Dense multi-head attention: encoder self-attention, decoder causal self-attention with a
KV cache, and encoder-decoder attention whose keys and values are computed once and cached.

Decode caches are stored head-major, ``[batch, heads, length, d_head]``, so the per-step
``q · K^T`` and ``p · V`` are batched over (batch, heads) with contiguous rows and XLA:CPU
never transposes the cache inside the step (``docs/design/cpu_decoding.md``). Cache variables are
created on the first decode call, guarded with ``has_variable``: ``init``/prefill *runs*
the body, so an unguarded index update would advance on creation
(``docs/design/jax_stack.md``, pitfall 7).
"""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from terra.backends import MASK_VALUE, cached_attention
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

    def _attend(self, q, k, v, bias, deterministic: bool) -> jax.Array:
        """Head-major core: q ``[b, h, lq, d]``, k/v ``[b, h, lk, d]``, bias broadcastable to
        ``[b, h, lq, lk]`` -> ``[b, h, lq, d]``."""
        q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) + bias
        probs = jax.nn.softmax(logits, axis=-1)
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
        return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v)

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

        In decode mode the keys and values of past tokens are the cache variables
        ``cached_key``/``cached_value`` ``[batch, heads, max_decode_length, d_head]`` with
        the write position ``cache_index``; the first (cache-creating) call only creates
        them. Later calls take one token.

        Prefill: a cache-creating call given ``prefix_mask`` ``[batch, length]`` (1 = real
        token) instead *writes* its ``length`` positions into cache slots ``[0, length)``,
        records which are real in ``key_mask`` ``[batch, max_decode_length]`` (padded slots
        are never attended to) and continues at ``cache_index = length``. Terraformer uses
        this for the encoder prefix of its concatenated decoder sequence.
        """
        if not decode:
            return self._attend(q, k, v, causal_bias(q.shape[2]), deterministic)
        initialized = self.has_variable("cache", "cached_key")
        if not initialized and max_decode_length is None:
            raise ValueError(f"{type(self).__name__}: the cache-creating decode call needs max_decode_length.")
        shape = (q.shape[0], k.shape[1], max_decode_length or 0, k.shape[3])
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
        if not initialized and prefix_mask is not None:
            length = q.shape[2]
            if length >= shape[2]:
                raise ValueError(
                    f"{type(self).__name__}: a prefix of {length} positions leaves no room in a cache of "
                    f"{shape[2]}; raise max_decode_length."
                )
            real = prefix_mask.astype(bool)
            bias = causal_bias(length) + padding_bias(real)
            cached_key.value = lax.dynamic_update_slice(cached_key.value, k, (0, 0, 0, 0))
            cached_value.value = lax.dynamic_update_slice(cached_value.value, v, (0, 0, 0, 0))
            key_mask = jnp.ones((shape[0], shape[2]), bool).at[:, :length].set(real)
            self.put_variable("cache", "key_mask", key_mask)
            cache_index.value = jnp.asarray(length, jnp.int32)
            return self._attend(q, k, v, bias, deterministic)
        if not initialized:
            return self._attend(q, k, v, causal_bias(q.shape[2]), deterministic)
        if q.shape[2] != 1:
            raise ValueError(
                f"{type(self).__name__} decode step expects one token per call, got {q.shape[2]} positions."
            )
        index = cache_index.value
        key_mask = self.get_variable("cache", "key_mask") if self.has_variable("cache", "key_mask") else None
        y, cached_key.value, cached_value.value = cached_attention(
            q,
            k,
            v,
            cached_key.value,
            cached_value.value,
            index,
            key_mask,
            dropout=lambda probs: nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic),
        )
        cache_index.value = index + 1
        return y

    def _encoder_keys_values(self, encoded, encoder_mask, *, decode: bool):
        """Head-major keys, values ``[batch, heads, kv_length, d_head]`` and the padding bias
        of the encoder output; in decode mode computed once and then read from the cache."""
        if decode and self.has_variable("cache", "cached_key"):
            return (
                self.get_variable("cache", "cached_key"),
                self.get_variable("cache", "cached_value"),
                self.get_variable("cache", "encoder_bias"),
            )
        if encoded is None or encoder_mask is None:
            raise ValueError(f"{type(self).__name__} needs the encoder output and mask on its first call.")
        keys, values = (self._heads_first(t) for t in self._project(encoded, 2, "kv"))
        bias = padding_bias(encoder_mask)
        if decode:
            self.put_variable("cache", "cached_key", keys)
            self.put_variable("cache", "cached_value", values)
            self.put_variable("cache", "encoder_bias", bias)
        return keys, values, bias

    @staticmethod
    def params_read_per_token(params) -> int:
        """Parameters one decoded token reads (encoder keys/values are cached, not read)."""
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
        keys, values, bias = self._encoder_keys_values(encoded, encoder_mask, decode=decode)
        y = self._attend(q, keys, values, bias, deterministic)
        return self._output(self._heads_first(y))
