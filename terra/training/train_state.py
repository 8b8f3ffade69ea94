"""The training state: one pytree that is sharded, donated to the train step and checkpointed."""

from typing import Any

import flax.struct
import jax


class TrainState(flax.struct.PyTreeNode):
    """``step`` (int32 scalar), ``params`` (unboxed parameter tree), ``opt_state`` (optax)."""

    step: jax.Array
    params: Any
    opt_state: Any
