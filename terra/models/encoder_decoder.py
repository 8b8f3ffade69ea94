"""Pre-LayerNorm encoder-decoder Transformer whose sparse-able layers are injected.

The paper's baseline (Table 1, "baseline Transf.") and, by swapping the injected layers in
gin, every Scaling Transformer row: the feed-forward block, the decoder self-attention
(sparse QKV), the encoder-decoder attention and the output logits (sparse loss) are
factories, called with the sizes from ``TransformerConfig``:

  feed_forward(d_model=, d_ff=, dropout_rate=, ff_dropout_rate=, dtype=)
      (x, *, deterministic, decode) -> [batch, length, d_model]
  encoder_attention(d_model=, n_heads=, dropout_rate=, dtype=)
      (x, mask, *, deterministic) -> [batch, length, d_model]
  decoder_self_attention(d_model=, n_heads=, dropout_rate=, dtype=[, cache_dtype=])
      (x, *, deterministic, decode, max_decode_length) -> [batch, length, d_model]
  encoder_decoder_attention(d_model=, n_heads=, dropout_rate=, dtype=[, cache_dtype=])
      (x, encoded, encoder_mask, *, deterministic, decode) -> [batch, length, d_model]
  logits_layer(vocab_size=, dtype=)
      (x) -> [batch, length, vocab] float32

Blocks follow the reference's ``ConfigurableTransformer``: ``x + Dropout(Attn(LN(x)))``,
``x + FF(LN(x))`` (the FF block ends with its own dropout), a final LayerNorm per stack,
a token embedding shared by encoder and decoder with separate positional tables, and an
untied logits layer. The decoder input is the targets shifted right with 0 as the start.
The decoder attentions get ``cache_dtype=`` only where ``TransformerConfig.cache_dtype`` stores
their decode caches narrow (``TransformerConfig.decoder_attention_kwargs``).

The embedding, residual and feed-forward output dropouts draw one mask per position by
default, as ``ConfigurableTransformer``'s default ``dropout_shared_axes=None`` (the
reference's C4 configs keep it); ``TransformerConfig.share_dropout_over_length=True`` shares
one mask per example over the length instead.
"""

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.layers import axes
from terra.layers.attention import CausalSelfAttention, CrossAttention, SelfAttention
from terra.layers.embedding import TokenEmbedding
from terra.layers.feedforward import FeedForward
from terra.layers.logits import DenseLogits
from terra.layers.normalization import LayerNorm
from terra.models.config import TransformerConfig

LayerFactory = Callable[..., nn.Module]

_ACTIVATION = (axes.BATCH, axes.LENGTH, axes.EMBED)


class EncoderLayer(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]``."""

    config: TransformerConfig
    attention: LayerFactory
    feed_forward: LayerFactory

    @nn.compact
    def __call__(self, x, mask, *, deterministic: bool):
        cfg = self.config
        y = LayerNorm(dtype=cfg.jnp_dtype, name="pre_attention_norm")(x)
        y = self.attention(**cfg.attention_kwargs(), name="attention")(y, mask, deterministic=deterministic)
        x = x + nn.Dropout(cfg.dropout, broadcast_dims=cfg.dropout_broadcast_dims)(y, deterministic=deterministic)
        y = LayerNorm(dtype=cfg.jnp_dtype, name="pre_ff_norm")(x)
        x = x + self.feed_forward(**cfg.feed_forward_kwargs(), name="feed_forward")(
            y, deterministic=deterministic, decode=False
        )
        return nn.with_logical_constraint(x, _ACTIVATION)


class DecoderLayer(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]``; length is 1 in decode mode."""

    config: TransformerConfig
    self_attention: LayerFactory
    cross_attention: LayerFactory
    feed_forward: LayerFactory

    @nn.compact
    def __call__(
        self, x, encoded, encoder_mask, *, deterministic: bool, decode: bool, max_decode_length: Optional[int]
    ):
        cfg = self.config
        dropout = nn.Dropout(cfg.dropout, broadcast_dims=cfg.dropout_broadcast_dims)
        y = LayerNorm(dtype=cfg.jnp_dtype, name="pre_self_attention_norm")(x)
        y = self.self_attention(**cfg.decoder_attention_kwargs(), name="self_attention")(
            y, deterministic=deterministic, decode=decode, max_decode_length=max_decode_length
        )
        x = x + dropout(y, deterministic=deterministic)
        y = LayerNorm(dtype=cfg.jnp_dtype, name="pre_cross_attention_norm")(x)
        y = self.cross_attention(**cfg.decoder_attention_kwargs(), name="cross_attention")(
            y, encoded, encoder_mask, deterministic=deterministic, decode=decode
        )
        x = x + dropout(y, deterministic=deterministic)
        y = LayerNorm(dtype=cfg.jnp_dtype, name="pre_ff_norm")(x)
        x = x + self.feed_forward(**cfg.feed_forward_kwargs(), name="feed_forward")(
            y, deterministic=deterministic, decode=decode
        )
        return nn.with_logical_constraint(x, _ACTIVATION)


def _after_stored(encoded: jax.Array, cache, encoder_mask: jax.Array) -> jax.Array:
    """``encoded`` unchanged, but computed only after ``cache`` (a decoder layer's stored caches).

    The prefill computes every decoder layer's encoder keys and values from ``encoded``; without
    this dependency XLA computes all of them in float32 first and narrows them last, holding every
    layer's float32 projections at once (3 GB at 15,360 inputs; XLA:CPU drops an
    ``optimization_barrier`` before scheduling). The added term is selected by a predicate that
    is false at run time (a mask is 0 or 1) but unknown at compile time, so it is exactly 0."""
    stored = sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(cache))
    never = encoder_mask.reshape(-1)[0] < 0
    return encoded + jnp.where(never, stored, 0.0).astype(encoded.dtype)


class EncoderDecoderTransformer(nn.Module):
    """Encoder-decoder Transformer (see the module docstring for the injection contract).

    Shapes: ``encoder_input_tokens`` ``[batch, input_length]``, ``decoder_input_tokens``
    ``[batch, target_length]``, optional ``encoder_mask`` ``[batch, input_length]`` (default
    ``tokens != pad_id``); logits ``[batch, target_length, vocab]`` in float32.
    """

    config: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    feed_forward: LayerFactory = FeedForward
    encoder_attention: LayerFactory = SelfAttention
    decoder_self_attention: LayerFactory = CausalSelfAttention
    encoder_decoder_attention: LayerFactory = CrossAttention
    logits_layer: LayerFactory = DenseLogits

    # ConfigurableTransformer's default dropout_shared_axes=None: one mask per position.
    REFERENCE_SHARES_DROPOUT_OVER_LENGTH = False

    def setup(self):
        cfg = self.config.with_dropout_sharing(self.REFERENCE_SHARES_DROPOUT_OVER_LENGTH)
        dtype = cfg.jnp_dtype
        self.token_embedding = TokenEmbedding(cfg.vocab_size, cfg.d_model, dtype=dtype)
        self.embedding_dropout = nn.Dropout(cfg.dropout, broadcast_dims=cfg.dropout_broadcast_dims)
        self.encoder_positions = cfg.positional_embedding()
        self.decoder_positions = cfg.positional_embedding()
        self.encoder_layers = [
            EncoderLayer(cfg, self.encoder_attention, self.feed_forward, name=f"encoder_{i}")
            for i in range(cfg.n_encoder_layers)
        ]
        self.encoder_norm = LayerNorm(dtype=dtype)
        self.decoder_layers = [
            DecoderLayer(
                cfg,
                self.decoder_self_attention,
                self.encoder_decoder_attention,
                self.feed_forward,
                name=f"decoder_{i}",
            )
            for i in range(cfg.n_decoder_layers)
        ]
        self.decoder_norm = LayerNorm(dtype=dtype)
        self.logits = self.logits_layer(vocab_size=cfg.vocab_size, dtype=dtype)

    def encoder_mask(self, encoder_input_tokens: jax.Array) -> jax.Array:
        return encoder_input_tokens != self.config.pad_id

    def encode(self, encoder_input_tokens, encoder_mask=None, *, deterministic: bool = True):
        """``[batch, input_length]`` tokens -> ``[batch, input_length, d_model]``."""
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        x = self.token_embedding(encoder_input_tokens)
        x = self.embedding_dropout(x, deterministic=deterministic)
        x = self.encoder_positions(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, _ACTIVATION)
        for layer in self.encoder_layers:
            x = layer(x, encoder_mask, deterministic=deterministic)
        return self.encoder_norm(x)

    def _decoder_hidden(self, decoder_input_tokens, encoded, encoder_mask, *, deterministic, decode, max_decode_length):
        x = self.token_embedding(decoder_input_tokens)
        x = self.embedding_dropout(x, deterministic=deterministic)
        x = self.decoder_positions(x, decode=decode, deterministic=deterministic)
        x = nn.with_logical_constraint(x, _ACTIVATION)
        prefill = decode and encoded is not None
        for layer in self.decoder_layers:
            x = layer(
                x,
                encoded,
                encoder_mask,
                deterministic=deterministic,
                decode=decode,
                max_decode_length=max_decode_length,
            )
            if prefill:
                encoded = _after_stored(encoded, layer.variables.get("cache", {}), encoder_mask)
        return self.decoder_norm(x)

    def decode(
        self,
        decoder_input_tokens,
        encoded=None,
        encoder_mask=None,
        *,
        deterministic: bool = True,
        decode: bool = False,
        max_decode_length: Optional[int] = None,
    ):
        """Decoder logits ``[batch, length, vocab]``.

        With ``decode=True`` the call consumes one token per row (``[batch, 1]``) and reads
        and updates the ``cache`` collection (pass ``mutable=['cache']``); ``encoded`` and
        ``encoder_mask`` are then only needed on the cache-creating call.
        """
        x = self._decoder_hidden(
            decoder_input_tokens,
            encoded,
            encoder_mask,
            deterministic=deterministic,
            decode=decode,
            max_decode_length=max_decode_length,
        )
        return self.logits(x)

    def decode_step(self, decoder_input_tokens, *, deterministic: bool = True):
        """One decode step after ``prefill_cache``: ``[batch, 1]`` tokens -> ``[batch, 1, vocab]``
        (pass ``mutable=['cache']``); the encoder's keys and values live in the caches."""
        return self.decode(decoder_input_tokens, deterministic=deterministic, decode=True)

    def prefill_cache(self, encoder_input_tokens, encoder_mask=None, *, max_decode_length: int):
        """Encode the inputs and create every decode cache (call with ``mutable=['cache']``).

        Runs the decoder once in decode mode on a dummy start token: that call creates the
        caches (self-attention caches of ``max_decode_length`` zeros at index 0, the
        encoder-decoder keys/values computed from the encoder output) and does not advance
        any index. Its output is discarded and the logits layer is skipped.
        """
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        encoded = self.encode(encoder_input_tokens, encoder_mask, deterministic=True)
        start = jnp.full((encoder_input_tokens.shape[0], 1), self.config.pad_id, jnp.int32)
        self._decoder_hidden(
            start, encoded, encoder_mask, deterministic=True, decode=True, max_decode_length=max_decode_length
        )

    def __call__(
        self,
        encoder_input_tokens,
        decoder_input_tokens,
        encoder_mask=None,
        *,
        deterministic: bool = True,
    ):
        """Teacher-forced forward pass: logits ``[batch, target_length, vocab]``."""
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        encoded = self.encode(encoder_input_tokens, encoder_mask, deterministic=deterministic)
        return self.decode(decoder_input_tokens, encoded, encoder_mask, deterministic=deterministic)
