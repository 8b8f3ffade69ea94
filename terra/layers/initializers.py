"""Weight initializers with explicit fans, shared by the layers whose stored shape is not the
``[in, out]`` matrix the reference initialises.

Kernels here are stored output-major or stacked (see ``terra.layers.dense``), so Flax's
shape-derived fans would be wrong; these take the fans of the matrix the reference draws.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def glorot_uniform(fan_in: int, fan_out: int):
    """Glorot-uniform with explicit fans: feed-forward weights are initialised as the
    ``[d_model, d_ff]`` and ``[d_ff, d_model]`` matrices the reference draws, whatever their
    stored shape (e.g. ``[d_ff / N, N, d_model]`` for the sparse feed-forward)."""
    limit = (6.0 / (fan_in + fan_out)) ** 0.5

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -limit, limit)

    return init


def stacked_glorot_uniform():
    """Glorot-uniform for a fused ``[heads, n_stack, d_head, d_model]`` kernel: each of the
    stacked projections (Q, K, V) is initialised as its own ``[d_model -> heads * d_head]``
    matrix."""
    return nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(3,), out_axis=(0, 2), batch_axis=(1,))
