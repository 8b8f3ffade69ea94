"""The pure train and eval steps: no I/O, no Python state; the trainer jits each once.

``train_step(model, tx, state, batch, rng) -> (state, metrics)``. The dropout key of a step is
``fold_in(rng, step)``, so a resumed run draws exactly the keys an uninterrupted one would.
A step whose loss or gradient norm is not finite leaves the state unchanged (``nonfinite`` = 1
in its metrics); the trainer then stops, so a NaN never reaches the parameters or a checkpoint.
"""

from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import optax

from terra.training.losses import token_cross_entropy
from terra.training.train_state import TrainState

Metrics = Dict[str, jax.Array]


def train_step(model, tx: optax.GradientTransformation, state: TrainState, batch, rng: jax.Array) -> Tuple[TrainState, Metrics]:
    """One optimizer step on ``batch`` (a dict of global arrays sharded over 'data')."""
    dropout_rng = jax.random.fold_in(rng, state.step)

    def loss_fn(params):
        return model.loss_fn(params, batch, dropout_rng)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    # Keep the last good state on a non-finite step rather than propagating NaNs.
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "loss_sum": aux["loss_sum"],
        "weight_sum": aux["weight_sum"],
        "correct": aux["correct"],
        "nonfinite": (~finite).astype(jnp.int32),
    }
    return new_state, metrics


def eval_step(model, params, batch) -> Metrics:
    """Summable metrics of one batch without dropout: NLL and token counts, correct tokens, and
    sequences whose every target token is right (the synthetic tasks' sequence accuracy)."""
    logits = model.logits(params, batch)
    targets = batch["decoder_target_tokens"]
    weights = batch.get("decoder_loss_weights")
    weights = (targets != 0) if weights is None else weights
    weights = weights.astype(jnp.float32)
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


def evaluate_batches(eval_fn, params, batches) -> Dict[str, float]:
    """Sums ``eval_fn(params, batch)`` (an :func:`eval_step`) over ``batches`` and summarizes
    it; ``{}`` when there is no batch."""
    totals = None
    for batch in batches:
        sums = eval_fn(params, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    return summarize_eval(totals) if totals is not None else {}


def summarize_eval(totals: Metrics) -> Dict[str, float]:
    """Summed eval metrics -> log-perplexity (nats per target token), token and sequence accuracy."""
    weight = max(float(totals["weight_sum"]), 1.0)
    return {
        "loss": float(totals["loss_sum"]) / weight,
        "token_accuracy": float(totals["correct"]) / weight,
        "sequence_accuracy": float(totals["sequences_correct"]) / max(float(totals["sequences"]), 1.0),
    }
