"""The one typed config that holds a model's sizes; it validates itself on construction.

Layer-specific knobs (``ff_sparsity``, ``temperature``, ...) belong to the injected layer
classes and are bound on them in gin; the sizes every layer shares live here, so a gin file
reads like a row of the paper's tables.
"""

import dataclasses
from typing import Optional

import jax.numpy as jnp

from terra.errors import ConfigError

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and regularisation of an encoder-decoder Transformer.

    Defaults are the paper's 800M-class baseline (Table 1; T5-large shapes: 24 + 24 layers,
    d_model 1024, d_ff 4096, 16 heads, vocabulary 32000).

    Attributes:
      vocab_size: size of the shared token vocabulary (pad = 0, EOS = 1).
      d_model: residual width.
      d_ff: feed-forward hidden width.
      n_heads: attention heads; ``d_head = d_model // n_heads``.
      n_encoder_layers / n_decoder_layers: block counts.
      max_len: rows of each positional table (longest encoder input / decoder output).
      dropout: residual-branch and embedding dropout (the reference's ``dropout``).
      ff_dropout: dropout inside the feed-forward block, before the ReLU (``ff_dropout``).
      attention_dropout: dropout on attention probabilities.
      dtype: computation dtype, 'float32' or 'bfloat16' (parameters stay float32).
      position_start_from_zero_prob, position_max_offset: random start offsets of the
        positional tables in training (the reference's ``pos_start_from_zero_prob`` and
        ``pos_max_offset_to_add``); the defaults (1.0, 0) always start at 0.
      share_dropout_over_length: draw one ``dropout`` mask per example and share it over
        every position (True), or an independent mask per position (False), for the
        embedding dropout, the residual dropout after attention and the feed-forward output
        dropout (the reference's ``dropout_shared_axes=[-2]`` against ``None``). ``None``
        (default) takes the model family's reference choice: not shared in
        ``EncoderDecoderTransformer`` (``ConfigurableTransformer``'s default
        ``dropout_shared_axes=None``), shared in ``Terraformer`` (``ConfigurableTerraformer``
        passes ``[-2]`` everywhere; ``docs/design/reference_code.md`` §4.1, §4.3). The dense
        feed-forward's inner ``ff_dropout`` is shared over length either way, as the reference
        hard-codes it, and attention-probability dropout is never shared.
      cache_dtype: how the decoder-side attentions store their decode caches (the self-attention
        KV cache and the cross-attention's encoder keys/values): 'float32' (the computation dtype,
        as before), 'bfloat16' or 'int8' (one float32 scale per batch, head and position;
        ``terra/backends/decode_state.py``). Training and the encoder are unaffected.
    """

    vocab_size: int = 32000
    d_model: int = 1024
    d_ff: int = 4096
    n_heads: int = 16
    n_encoder_layers: int = 24
    n_decoder_layers: int = 24
    max_len: int = 2048
    dropout: float = 0.1
    ff_dropout: float = 0.1
    attention_dropout: float = 0.1
    dtype: str = "float32"
    pad_id: int = 0
    eos_id: int = 1
    position_start_from_zero_prob: float = 1.0
    position_max_offset: int = 0
    share_dropout_over_length: Optional[bool] = None
    cache_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_ff", "n_heads", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"TransformerConfig.{name}={value!r} must be a positive integer.")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"TransformerConfig.{name}={value!r} must be a non-negative integer.")
        if self.n_decoder_layers == 0:
            raise ConfigError(
                "TransformerConfig.n_decoder_layers=0: an encoder-decoder needs at least one decoder layer."
            )
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, min(self.d_model, 128) + 1) if self.d_model % h == 0]
            raise ConfigError(
                f"TransformerConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads from {divisors[-8:]} or change d_model to a multiple of {self.n_heads} "
                f"(e.g. {self.n_heads * max(1, round(self.d_model / self.n_heads))})."
            )
        for name in ("dropout", "ff_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"TransformerConfig.{name}={value!r} must be in [0, 1).")
        if not 0.0 <= self.position_start_from_zero_prob <= 1.0 or self.position_max_offset < 0:
            raise ConfigError(
                f"TransformerConfig.position_start_from_zero_prob={self.position_start_from_zero_prob} must be in "
                f"[0, 1] and position_max_offset={self.position_max_offset} >= 0."
            )
        if not (self.share_dropout_over_length is None or isinstance(self.share_dropout_over_length, bool)):
            raise ConfigError(
                f"TransformerConfig.share_dropout_over_length={self.share_dropout_over_length!r} must be True "
                "(one dropout mask per example, shared over positions), False (one per position) or None "
                "(the model family's reference choice)."
            )
        from terra.backends.decode_state import check_cache_dtype

        check_cache_dtype(self.cache_dtype)
        if self.dtype not in _DTYPES:
            raise ConfigError(f"TransformerConfig.dtype={self.dtype!r}; use one of {sorted(_DTYPES)}.")
        if not (0 <= self.pad_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size):
            raise ConfigError(
                f"pad_id={self.pad_id} and eos_id={self.eos_id} must be ids inside vocab_size={self.vocab_size}."
            )

    def positional_embedding(self, **kwargs):
        """A ``TrainablePositionalEmbedding`` with this config's table size and offsets."""
        from terra.layers.positional import TrainablePositionalEmbedding

        return TrainablePositionalEmbedding(
            self.max_len,
            dtype=self.jnp_dtype,
            start_from_zero_prob=self.position_start_from_zero_prob,
            max_offset=self.position_max_offset,
            **kwargs,
        )

    def with_dropout_sharing(self, family_default: bool) -> "TransformerConfig":
        """This config with ``share_dropout_over_length`` decided: ``family_default`` (the model
        family's reference choice) where it is None, else unchanged. Models call this once and
        build their layers from the result."""
        if self.share_dropout_over_length is not None:
            return self
        return dataclasses.replace(self, share_dropout_over_length=family_default)

    @property
    def dropout_broadcast_dims(self) -> tuple:
        """``broadcast_dims`` of a residual, embedding or feed-forward output ``nn.Dropout`` over
        ``[batch, length, d_model]``: ``(-2,)`` (one mask per example) or ``()`` (per position)."""
        if self.share_dropout_over_length is None:
            raise ValueError(
                "TransformerConfig.share_dropout_over_length is undecided; build layers from "
                "config.with_dropout_sharing(family_default) (the models do)."
            )
        from terra.layers.axes import dropout_broadcast_dims

        return dropout_broadcast_dims(self.share_dropout_over_length)

    def attention_kwargs(self) -> dict:
        """What every injected attention layer is constructed with (``d_model``, ``n_heads``,
        ``dropout_rate`` = the attention-probability dropout, ``dtype``)."""
        return dict(
            d_model=self.d_model, n_heads=self.n_heads, dropout_rate=self.attention_dropout, dtype=self.jnp_dtype
        )

    def decoder_attention_kwargs(self) -> dict:
        """What a decoder-side attention (self, cross, Terraformer's decoder attention) is
        constructed with: :meth:`attention_kwargs`, plus ``cache_dtype`` where the caches are
        stored narrow (float32 passes nothing, so any attention factory keeps working)."""
        kwargs = self.attention_kwargs()
        if self.cache_dtype != "float32":
            kwargs["cache_dtype"] = self.cache_dtype
        return kwargs

    def feed_forward_kwargs(self) -> dict:
        """What every injected feed-forward layer is constructed with (``d_model``, ``d_ff``,
        ``dropout_rate`` = its output dropout, ``ff_dropout_rate`` = the inner one,
        ``share_dropout_over_length`` for the output dropout's mask, ``dtype``)."""
        return dict(
            d_model=self.d_model,
            d_ff=self.d_ff,
            dropout_rate=self.dropout,
            ff_dropout_rate=self.ff_dropout,
            share_dropout_over_length=bool(self.dropout_broadcast_dims),
            dtype=self.jnp_dtype,
        )

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]
