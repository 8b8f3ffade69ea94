"""Weighted token cross-entropy with padding masked out."""

from typing import Optional, Tuple

import jax
import jax.numpy as jnp


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood: logits ``[..., vocab]``, targets ``[...]`` -> ``[...]``."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit


def weighted_cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: Optional[jax.Array] = None, *, pad_id: int = 0
) -> Tuple[jax.Array, jax.Array]:
    """Returns ``(sum of weighted NLL, sum of weights)``.

    ``weights`` defaults to ``targets != pad_id``, so padding never contributes; dividing
    the two sums gives the log-perplexity per target token.
    """
    if weights is None:
        weights = (targets != pad_id).astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    nll = token_cross_entropy(logits, targets)
    return jnp.sum(nll * weights), jnp.sum(weights)
