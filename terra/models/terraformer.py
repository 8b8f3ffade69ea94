"""Terraformer (paper §4): a reversible encoder and a LengthConcat decoder with two attentions.

Data flow (reference ``ConfigurableTerraformer``, ``docs/design/reference_code.md`` §4.1–§4.3)::

  encoder   embed(tokens_e) -> dropout -> + encoder positions -> (x, x)
            ReversibleStack([HalfResidual(LN, encoder attention), FeedForwardWithSRU] * n_enc)
            reversible_encoder=True:  each of the two streams goes on separately
            reversible_encoder=False: (x1 + x2) / 2 -> Dense(d) -> LayerNorm, duplicated
  concat    per stream: [real encoder vectors, decoder embeddings, zeros]  (LengthConcat)
  decoder   ReversibleStack([HalfResidual(LN, attn_1), HalfResidual(LN, attn_2),
                             FeedForwardWithSRU] * n_dec)       causal over the whole sequence
  end       (y1 + y2) / 2 -> LayerNorm -> strip to the decoder positions -> logits

There is no cross-attention: decoder tokens see the encoder through the causal attention
of the concatenated sequence, and the encoder positions go through the decoder layers too.
The token embedding is shared by encoder and decoder; each has its own positional table.
Every half-residual is followed by a swap (two per encoder block, three per decoder
block); the reference's ``use_two_swaps_per_encoder_block=False`` is not offered.

Dropout follows ``ConfigurableTerraformer`` (``docs/design/reference_code.md`` §4.1–§4.3,
§8 item 13): the embedding and the feed-forward output dropouts share one mask per example
over the length (``TransformerConfig.share_dropout_over_length`` resolves to True here), and
the attention half-residuals have no output dropout, since the reference's ``Attention``,
``CausalAttention``, ``MultiplicativeConvCausalAttention`` and ``PureLSHSelfAttention`` have
none. ``attention_output_dropout=True`` adds it (Trax's ``SelfAttention`` and
``LSHSelfAttention`` classes, e.g. the reference's ``scientific_papers_terraformer.gin``).

The injected layers follow ``EncoderDecoderTransformer``'s contract, plus:

  decoder_attention(d_model=, n_heads=, dropout_rate=, dtype=[, cache_dtype=])
      (x, *, deterministic, decode, max_decode_length, prefix_mask) -> [batch, length, d_model]
      (``CausalSelfAttention``, ``SparseQKVAttention``, ``LSHSelfAttention``)

Decode follows the same ``prefill``/``step`` contract as the other models
(``terra.decoding.IncrementalDecoder``). ``prefill_cache`` encodes the input, packs the real
encoder vectors first, and runs the decoder stack once over that prefix with
``prefix_mask``: every attention writes the prefix's keys and values into its cache (the
padded slots are masked for good), the sparse-QKV convolutions keep the rows just before
the padding, and the SRUs their carry after the last real token (the reference's portal
mask, §4.7). Each ``step`` then runs one decoder token, written after the prefix. Softmax
attention does not depend on where a key sits in the cache, so this equals the teacher-forced
forward pass over ``[real encoder, decoder, zeros]`` at every position, for any batch.
"""

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.attention import CausalSelfAttention, SelfAttention
from terra.layers.dense import Dense
from terra.layers.embedding import TokenEmbedding
from terra.layers.feedforward import FeedForward
from terra.layers.feedforward_with_sru import FeedForwardWithSRU
from terra.layers.length_concat import LengthConcat
from terra.layers.logits import DenseLogits
from terra.layers.normalization import LayerNorm
from terra.layers.reversible import HalfResidual, ReversibleStack
from terra.models.config import TransformerConfig
from terra.models.encoder_decoder import LayerFactory

_ACTIVATION = (axes.BATCH, axes.LENGTH, axes.EMBED)
_DECODER_ATTENTION_KWARGS = ("deterministic", "decode", "max_decode_length", "prefix_mask")
_FEED_FORWARD_KWARGS = ("deterministic", "decode", "prefix_mask")


class Terraformer(nn.Module):
    """Terraformer encoder-decoder (see the module docstring).

    Shapes: ``encoder_input_tokens`` ``[batch, L1]``, ``decoder_input_tokens`` ``[batch, L2]``,
    optional ``encoder_mask`` ``[batch, L1]`` (default ``tokens != pad_id``); logits
    ``[batch, L2, vocab]`` float32. The decoder runs over ``L1 + L2`` positions.

    Attributes:
      config: sizes and dropouts (``TransformerConfig``; ``max_len`` bounds each of the
        encoder input and the decoder output, as each has its own positional table).
      feed_forward, encoder_attention, decoder_attention, logits_layer: injected layers.
      sru_units: the low-rank SRU branch's width in every feed-forward block (32); 0 = none.
      sru_layers: SRU layers in that branch (1).
      n_decoder_attention_layers: attention half-residuals per decoder block (2).
      reversible: rebuild activations in the backward pass (custom VJP; memory flat in
        depth). False runs the same functions under plain autodiff (same values and grads).
      reversible_encoder: keep the encoder's two streams separate into the decoder (the C4
        and arXiv configs); False merges them with ``(x1+x2)/2 -> Dense -> LayerNorm``.
      center_layernorm: LayerNorm (True) or RMSNorm (False) for the norms inside the blocks (before
        attention, the feed-forward and the SRU branch); the norm after a non-reversible encoder and
        the final norm are centred either way, as in the reference.
      attention_output_dropout: apply ``config.dropout`` to every attention sublayer's output
        (False, the reference with the attentions the configs use: none of them has an output
        dropout; True for Trax's ``SelfAttention``/``LSHSelfAttention``, which have one).
    """

    config: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    feed_forward: LayerFactory = FeedForward
    encoder_attention: LayerFactory = SelfAttention
    decoder_attention: LayerFactory = CausalSelfAttention
    logits_layer: LayerFactory = DenseLogits
    sru_units: int = 32
    sru_layers: int = 1
    n_decoder_attention_layers: int = 2
    reversible: bool = True
    reversible_encoder: bool = True
    center_layernorm: bool = True
    attention_output_dropout: bool = False

    # ConfigurableTerraformer passes dropout_shared_axes=[-2] to every embedding and FF dropout.
    REFERENCE_SHARES_DROPOUT_OVER_LENGTH = True

    def setup(self):
        cfg = self.config.with_dropout_sharing(self.REFERENCE_SHARES_DROPOUT_OVER_LENGTH)
        self._cfg = cfg  # the blocks are built from the config with its dropout sharing decided
        dtype = cfg.jnp_dtype
        if self.n_decoder_attention_layers < 1 or self.sru_units < 0 or self.sru_layers < 1:
            raise ConfigError(
                f"Terraformer: n_decoder_attention_layers={self.n_decoder_attention_layers} must be >= 1, "
                f"sru_units={self.sru_units} >= 0 (0 = no SRU) and sru_layers={self.sru_layers} >= 1."
            )
        self.token_embedding = TokenEmbedding(cfg.vocab_size, cfg.d_model, dtype=dtype)
        self.embedding_dropout = nn.Dropout(cfg.dropout, broadcast_dims=cfg.dropout_broadcast_dims)
        self.encoder_positions = cfg.positional_embedding()
        self.decoder_positions = cfg.positional_embedding()
        encoder_halves = []
        for _ in range(cfg.n_encoder_layers):
            encoder_halves += [
                self._attention_half(self.encoder_attention, encoder=True),
                self._feed_forward_half(False),
            ]
        self.encoder_stack = ReversibleStack(encoder_halves, reversible=self.reversible)
        if not self.reversible_encoder:
            # d_model -> d_model; the input side takes the "mlp" name so the two axes shard apart.
            self.encoder_merge = Dense(cfg.d_model, kernel_axes=(axes.EMBED, axes.MLP), dtype=dtype)
            # Centred whatever center_layernorm says: the reference's plain tl.LayerNorm() here.
            self.encoder_norm = LayerNorm(dtype=dtype)
        decoder_halves = []
        for _ in range(cfg.n_decoder_layers):
            decoder_halves += [
                self._attention_half(self.decoder_attention, encoder=False)
                for _ in range(self.n_decoder_attention_layers)
            ]
            decoder_halves.append(self._feed_forward_half(True))
        self.decoder_stack = ReversibleStack(decoder_halves, reversible=self.reversible)
        self.decoder_norm = LayerNorm(dtype=dtype)  # centred always, as the reference's final tl.LayerNorm()
        self.logits = self.logits_layer(vocab_size=cfg.vocab_size, dtype=dtype)

    # ----- blocks -------------------------------------------------------------------------
    def _attention_half(self, factory: LayerFactory, *, encoder: bool):
        cfg = self._cfg

        def build():
            return HalfResidual(
                factory(**(cfg.attention_kwargs() if encoder else cfg.decoder_attention_kwargs())),
                pre_norm=True,
                center_layernorm=self.center_layernorm,
                dropout_rate=cfg.dropout if self.attention_output_dropout else 0.0,
                share_dropout_over_length=cfg.share_dropout_over_length,
                decisions_kwarg="buckets",  # LSH attention replays its hashing; others sow nothing
                pass_context=encoder,  # the encoder's padding mask
                pass_kwargs=("deterministic",) if encoder else _DECODER_ATTENTION_KWARGS,
                dtype=cfg.jnp_dtype,
            )

        return build

    def _feed_forward_half(self, decoder: bool):
        cfg = self._cfg

        def build():
            block = FeedForwardWithSRU(
                self.feed_forward(**cfg.feed_forward_kwargs()),
                d_model=cfg.d_model,
                sru_units=self.sru_units,
                sru_layers=self.sru_layers,
                center_layernorm=self.center_layernorm,
                dtype=cfg.jnp_dtype,
            )
            return HalfResidual(
                block,
                pre_norm=False,  # the block has its own norms
                decisions_kwarg="indices",  # a sparse feed-forward replays its block choices
                pass_kwargs=_FEED_FORWARD_KWARGS if decoder else ("deterministic",),
                dtype=cfg.jnp_dtype,
            )

        return build

    # ----- encoder ------------------------------------------------------------------------
    def encoder_mask(self, encoder_input_tokens: jax.Array) -> jax.Array:
        return encoder_input_tokens != self.config.pad_id

    def encode(self, encoder_input_tokens, encoder_mask=None, *, deterministic: bool = True):
        """``[batch, L1]`` tokens -> the two streams ``([batch, L1, d_model],) * 2`` that enter
        the decoder's concatenation (equal when ``reversible_encoder=False``)."""
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        x = self.token_embedding(encoder_input_tokens)
        x = self.embedding_dropout(x, deterministic=deterministic)
        x = nn.with_logical_constraint(self.encoder_positions(x, deterministic=deterministic), _ACTIVATION)
        x1, x2 = self.encoder_stack(x, x, encoder_mask, deterministic=deterministic)
        if self.reversible_encoder:
            return x1, x2
        merged = self.encoder_norm(self.encoder_merge((x1 + x2) * 0.5))
        return merged, merged

    # ----- decoder ------------------------------------------------------------------------
    def _embed_decoder(self, decoder_input_tokens, *, deterministic: bool, decode: bool):
        x = self.token_embedding(decoder_input_tokens)
        x = self.embedding_dropout(x, deterministic=deterministic)
        x = self.decoder_positions(x, decode=decode, deterministic=deterministic)
        return nn.with_logical_constraint(x, _ACTIVATION)

    def _output(self, y1, y2):
        return self.decoder_norm((y1 + y2) * 0.5)

    def __call__(self, encoder_input_tokens, decoder_input_tokens, encoder_mask=None, *, deterministic: bool = True):
        """Teacher-forced forward pass: logits ``[batch, L2, vocab]``."""
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        e1, e2 = self.encode(encoder_input_tokens, encoder_mask, deterministic=deterministic)
        d = self._embed_decoder(decoder_input_tokens, deterministic=deterministic, decode=False)
        layout = LengthConcat.from_mask(encoder_mask, decoder_input_tokens.shape[1])
        y1, y2 = self.decoder_stack(layout.concat(e1, d), layout.concat(e2, d), deterministic=deterministic)
        y = layout.strip(self._output(y1, y2))
        return self.logits(y)

    def prefill_cache(self, encoder_input_tokens, encoder_mask=None, *, max_decode_length: int):
        """Encode the inputs and fill every decoder cache with the encoder prefix (call with
        ``mutable=['cache']``). The caches hold ``L1 + max_decode_length`` positions."""
        if encoder_mask is None:
            encoder_mask = self.encoder_mask(encoder_input_tokens)
        batch, l1 = encoder_input_tokens.shape
        e1, e2 = self.encode(encoder_input_tokens, encoder_mask, deterministic=True)
        layout = LengthConcat.from_mask(encoder_mask, max_decode_length)
        e1, e2, real = layout.pack_real_first(e1), layout.pack_real_first(e2), layout.packed_mask()
        # Creates the decoder's position counter at 0 (a cache-creating call does not advance).
        self.decoder_positions(jnp.zeros((batch, 1, self.config.d_model), e1.dtype), decode=True)
        self.decoder_stack(
            e1,
            e2,
            deterministic=True,
            decode=True,
            max_decode_length=l1 + max_decode_length,
            prefix_mask=real,
        )

    def decode_step(self, decoder_input_tokens, *, deterministic: bool = True):
        """One decode step after ``prefill_cache``: ``[batch, 1]`` tokens -> ``[batch, 1, vocab]``
        (pass ``mutable=['cache']``). The encoder output lives in the caches."""
        x = self._embed_decoder(decoder_input_tokens, deterministic=deterministic, decode=True)
        y1, y2 = self.decoder_stack(x, x, deterministic=deterministic, decode=True)
        return self.logits(self._output(y1, y2))


def shared_qk_from_dense_attention(params, scopes: Sequence[str] = ("encoder_stack",)):
    """A ``param_map`` for fine-tuning (``terra.training.Trainer.param_map``): initialise LSH attention
    from a checkpoint trained with dense attention.

    Inside the subtrees named in ``scopes`` (default: the encoder, whose dense attention
    ``terraformer_lsh_800m.gin`` replaces with LSH), every fused dense projection ``qkv``
    (kernel ``[heads, 3, d_head, d_model]``, bias ``[heads, 3, d_head]``) becomes LSH's ``qv``
    with the shared query-key set to the mean of the query and key projections (the
    reference's ``QKAvg`` for ``num_weights=3``); the output projection keeps its name.
    Sparse-QKV attention needs no map: LSH's 'sparse' format has the same parameter tree.
    Everything else passes through unchanged.
    """

    def convert(tree):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for name, value in tree.items():
            if name == "qkv" and isinstance(value, dict):
                out["qv"] = {k: jnp.stack([(v[:, 0] + v[:, 1]) * 0.5, v[:, 2]], axis=1) for k, v in value.items()}
            else:
                out[name] = convert(value)
        return out

    return {name: convert(value) if name in scopes else value for name, value in params.items()}
