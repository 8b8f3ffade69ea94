"""The model protocol: what training, evaluation, the Python API and the benchmarks may ask of
a model, and nothing else.

Every model family (the dense and sparse encoder-decoders of the Scaling Transformer, the
Terraformer with dense or LSH attention) implements it; ``terra.training``,
``terra.evaluation`` and ``terra.benchmarks`` are written against it, so a new family is a new
class here, not an edit there. Batches use seqio's encoder-decoder feature names:
``encoder_input_tokens`` ``[batch, input_length]``, ``decoder_target_tokens``
``[batch, target_length]`` and optionally ``decoder_input_tokens`` (default: the targets
shifted right with the pad id first) and ``decoder_loss_weights`` (default: targets != pad).
"""

from typing import Any, Dict, Mapping, Optional, Protocol, Tuple, runtime_checkable

import flax.linen as nn
import jax

from terra.decoding.decode_step import IncrementalDecoder
from terra.models.config import TransformerConfig

Batch = Mapping[str, jax.Array]
Params = Any


@runtime_checkable
class Model(Protocol):
    """A sequence-to-sequence model: a Flax ``module`` and the functions around it.

    Attributes:
      config: the sizes every layer shares (``pad_id`` and ``eos_id`` included).
      module: the Flax network; it exposes ``__call__(encoder_input_tokens,
        decoder_input_tokens, encoder_mask=None, *, deterministic)`` for teacher forcing and
        the decode contract ``prefill_cache`` / ``decode_step``.
    """

    config: TransformerConfig
    module: nn.Module

    # ----- parameters ---------------------------------------------------------------------
    def abstract_variables(self) -> Dict:
        """Shapes and logical axes of every variable, nothing allocated."""

    def init_variables(self, rng: jax.Array) -> Dict:
        """Random variables, still boxed with their logical axis names (jit- and
        ``eval_shape``-able: the trainer traces it to shard the state it creates)."""

    def init_params(self, rng: jax.Array) -> Params:
        """Random parameters as a plain (unboxed) pytree."""

    def param_count(self) -> Dict[str, int]:
        """Parameters per top-level group, plus ``'total'``."""

    def params_read_per_token(self, batch: int = 1) -> Dict[str, int]:
        """Parameters one decode step of ``batch`` sequences reads (the union of the rows they
        select), by part, plus ``'total'``; batch 1 by default."""

    # ----- training and scoring ------------------------------------------------------------
    def logits(self, params: Params, batch: Batch, *, dropout_rng: Optional[jax.Array] = None) -> jax.Array:
        """Teacher-forced logits ``[batch, target_length, vocab]`` float32."""

    def loss_fn(self, params: Params, batch: Batch, dropout_rng: Optional[jax.Array] = None) -> Tuple[jax.Array, Dict]:
        """``(mean loss per target token, summable metrics)``; dropout iff ``dropout_rng``."""

    def eval_metrics(self, params: Params, batch: Batch) -> Dict[str, jax.Array]:
        """Summable evaluation sums of a batch without dropout (see ``terra.models.losses``)."""

    def score(self, params: Params, batch: Batch) -> jax.Array:
        """``[batch]`` log-likelihood of each row's weighted target tokens."""

    # ----- decoding ------------------------------------------------------------------------
    def decoder(self, max_decode_length: int) -> IncrementalDecoder:
        """The jitted prefill / step / generation loop for a cache of that many tokens."""

    def generate(self, params: Params, encoder_input_tokens, *, max_decode_length: int, **options):
        """Decode up to ``max_decode_length`` tokens per row (greedy, sampled or beam search)."""
