"""The models' losses and metrics: weighted token cross-entropy with padding masked out, and
the summable evaluation sums every model family reports (log-perplexity, token and sequence
accuracy)."""

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

Metrics = Dict[str, jax.Array]


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood: logits ``[..., vocab]``, targets ``[...]`` -> ``[...]``."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit


def target_weights(targets: jax.Array, weights: Optional[jax.Array] = None, *, pad_id: int = 0) -> jax.Array:
    """``[batch, length]`` float32 loss weights: ``weights`` when given, else ``targets != pad_id``."""
    if weights is None:
        weights = targets != pad_id
    return weights.astype(jnp.float32)


def weighted_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: Optional[jax.Array] = None, *, pad_id: int = 0
) -> Tuple[jax.Array, jax.Array]:
    """Returns ``(sum of weighted NLL, sum of weights)``.

    ``weights`` defaults to ``targets != pad_id``, so padding never contributes; dividing
    the two sums gives the log-perplexity per target token.
    """
    weights = target_weights(targets, weights, pad_id=pad_id)
    nll = token_cross_entropy(logits, targets)
    return jnp.sum(nll * weights), jnp.sum(weights)


def evaluation_sums(
    logits: jax.Array, targets: jax.Array, weights: Optional[jax.Array] = None, *, pad_id: int = 0
) -> Metrics:
    """Summable metrics of one batch: NLL and token counts, correct tokens, and sequences whose
    every weighted target token is right (the synthetic tasks' sequence accuracy).

    Args: ``logits`` ``[batch, length, vocab]``, ``targets`` ``[batch, length]``, optional
    ``weights`` ``[batch, length]`` (default ``targets != pad_id``).
    """
    weights = target_weights(targets, weights, pad_id=pad_id)
    nll = token_cross_entropy(logits, targets)
    right = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * weights
    has_target = jnp.sum(weights, -1) > 0
    sequence_right = (jnp.sum(right, -1) == jnp.sum(weights, -1)) & has_target
    return {
        "loss_sum": jnp.sum(nll * weights),
        "weight_sum": jnp.sum(weights),
        "correct": jnp.sum(right),
        "sequences": jnp.sum(has_target.astype(jnp.float32)),
        "sequences_correct": jnp.sum(sequence_right.astype(jnp.float32)),
    }


def summarize_evaluation(totals: Metrics) -> Dict[str, float]:
    """Summed :func:`evaluation_sums` -> log-perplexity (nats per target token), token and
    sequence accuracy."""
    weight = max(float(totals["weight_sum"]), 1.0)
    return {
        "loss": float(totals["loss_sum"]) / weight,
        "token_accuracy": float(totals["correct"]) / weight,
        "sequence_accuracy": float(totals["sequences_correct"]) / max(float(totals["sequences"]), 1.0),
    }
