"""The pure train step and the evaluation sum: no I/O, no Python state; the trainer jits each once.

``train_step(model, tx, state, batch, rng) -> (state, metrics)``. The dropout key of a step is
``fold_in(rng, step)``, so a resumed run draws exactly the keys an uninterrupted one would.
A step whose loss or gradient norm is not finite leaves the state unchanged (``nonfinite`` = 1
in its metrics); the trainer then stops, so a NaN never reaches the parameters or a checkpoint.
"""

from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import optax

from terra.models import losses
from terra.training.train_state import TrainState

Metrics = Dict[str, jax.Array]


def train_step(
    model, tx: optax.GradientTransformation, state: TrainState, batch, rng: jax.Array
) -> Tuple[TrainState, Metrics]:
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


def evaluate_batches(eval_fn, params, batches) -> Dict[str, float]:
    """Sums ``eval_fn(params, batch)`` (a jitted ``Model.eval_metrics``) over ``batches`` and
    summarizes it (``terra.models.losses.summarize_evaluation``); ``{}`` when there is no batch."""
    totals = None
    for batch in batches:
        sums = eval_fn(params, batch)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    return losses.summarize_evaluation(totals) if totals is not None else {}
