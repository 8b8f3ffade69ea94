"""The model wrapper: owns initialisation, loss, log-perplexity and prediction.

It wraps a Flax module (the network) the way T5X's ``EncoderDecoderModel`` does, so the
trainer and evaluator only see pytrees and functions. Batches use seqio's encoder-decoder
feature names: ``encoder_input_tokens``, ``decoder_target_tokens`` and optionally
``decoder_input_tokens`` (default: targets shifted right, 0 first) and
``decoder_loss_weights`` (default: targets != pad).
"""

import functools
from typing import Dict, Mapping, Optional, Tuple

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from terra.decoding.decode_step import IncrementalDecoder
from terra.decoding.generate import Generation, generate
from terra.training.losses import weighted_cross_entropy

Batch = Mapping[str, jax.Array]


def shift_right(targets: jax.Array, start_id: int = 0) -> jax.Array:
    """``[batch, length]`` -> decoder inputs: ``start_id`` then the targets minus the last."""
    start = jnp.full_like(targets[:, :1], start_id)
    return jnp.concatenate([start, targets[:, :-1]], axis=1)


class EncoderDecoderModel:
    """Loss, scoring and prediction for an encoder-decoder module.

    Args:
      module: the network, e.g. ``EncoderDecoderTransformer`` (gin: ``EncoderDecoderModel.module``).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.config = module.config
        # Build the whole variable tree abstractly now (nothing is allocated), so that
        # incompatible sizes in any injected layer (d_ff % N, d_model % S, vocab % S) fail
        # when the model is configured, not in the middle of a training job.
        self._abstract = jax.eval_shape(self._init_variables, jax.random.key(0))

    # ----- parameters -------------------------------------------------------------------
    def _init_variables(self, rng):
        # Parameter shapes do not depend on lengths; short dummy sequences keep init cheap.
        length = min(8, self.config.max_len)
        inputs = jnp.ones((1, length), jnp.int32)
        targets = jnp.ones((1, length), jnp.int32)
        return self.module.init({"params": rng, "dropout": rng}, inputs, targets)

    def abstract_variables(self):
        """Shapes and logical axes of every variable (``LogicallyPartitioned`` boxes), computed
        with ``jax.eval_shape``: nothing is allocated, so any size works."""
        return self._abstract

    def init_params(self, rng) -> Dict:
        """Random parameters as a plain (unboxed) pytree."""
        return nn.unbox(jax.jit(self._init_variables)(rng))["params"]

    # ----- training and scoring ---------------------------------------------------------
    def _decoder_inputs(self, batch: Batch) -> jax.Array:
        if "decoder_input_tokens" in batch:
            return batch["decoder_input_tokens"]
        return shift_right(batch["decoder_target_tokens"], self.config.pad_id)

    def logits(self, params, batch: Batch, *, dropout_rng: Optional[jax.Array] = None) -> jax.Array:
        """Teacher-forced logits ``[batch, target_length, vocab]``; dropout on iff a
        ``dropout_rng`` is given."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            self._decoder_inputs(batch),
            batch.get("encoder_mask"),
            deterministic=dropout_rng is None,
            rngs=rngs,
        )

    def loss_fn(
        self, params, batch: Batch, dropout_rng: Optional[jax.Array] = None
    ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
        """Mean weighted cross-entropy per target token, and summable metrics."""
        logits = self.logits(params, batch, dropout_rng=dropout_rng)
        targets = batch["decoder_target_tokens"]
        weights = batch.get("decoder_loss_weights")
        loss_sum, weight_sum = weighted_cross_entropy(logits, targets, weights, pad_id=self.config.pad_id)
        if weights is None:
            weights = targets != self.config.pad_id
        correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
        loss = loss_sum / jnp.maximum(weight_sum, 1.0)
        return loss, {"loss_sum": loss_sum, "weight_sum": weight_sum, "correct": correct}

    @functools.cached_property
    def _jit_loss(self):
        return jax.jit(lambda params, batch: self.loss_fn(params, batch)[1])

    def loss_sums(self, params, batch: Batch) -> Dict[str, float]:
        """Summable teacher-forced metrics of a batch, no dropout: ``loss_sum`` (nats),
        ``weight_sum`` (target tokens), ``correct`` (argmax hits); jitted once per shape."""
        return {k: float(v) for k, v in jax.device_get(self._jit_loss(params, dict(batch))).items()}

    def log_perplexity(self, params, batch: Batch) -> float:
        """Mean negative log-likelihood (nats) per non-pad target token, no dropout."""
        metrics = self.loss_sums(params, batch)
        return metrics["loss_sum"] / max(metrics["weight_sum"], 1.0)

    # ----- decoding ---------------------------------------------------------------------
    @functools.lru_cache(maxsize=8)
    def decoder(self, max_decode_length: int) -> IncrementalDecoder:
        """The jitted prefill/step pair for a cache of ``max_decode_length`` tokens (cached,
        so each length compiles once)."""
        return IncrementalDecoder(self.module, max_decode_length)

    def predict(
        self,
        params,
        encoder_input_tokens,
        *,
        max_decode_length: int,
        temperature: float = 0.0,
        seed: int = 0,
        encoder_mask=None,
    ) -> Generation:
        """Generate up to ``max_decode_length`` tokens per row, stopping each row at EOS."""
        return generate(
            self.decoder(max_decode_length),
            params,
            encoder_input_tokens,
            encoder_mask=encoder_mask,
            temperature=temperature,
            seed=seed,
            eos_id=self.config.eos_id,
            pad_id=self.config.pad_id,
        )


gin.register(EncoderDecoderModel, module="terra.models")
