"""Dense feed-forward block: the baseline at the paper's feed-forward swap point.

``docs/design/reference_code.md`` §4.3: ``Dense(d_ff) -> Dropout(ff_dropout) -> ReLU -> Dense(d_model)
-> Dropout(dropout)``, both dropouts shared over the length axis; the ff dropout comes
*before* the ReLU. ``SparseFeedForward`` replaces this module with one gin line.
"""

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from terra.layers import axes
from terra.layers.dense import Dense


class FeedForward(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]``.

    Injected-layer contract (shared with the sparse variants): constructed with
    ``d_model, d_ff, dropout_rate, ff_dropout_rate, dtype``; called as
    ``(x, *, deterministic, decode)``.
    """

    d_model: int
    d_ff: int
    dropout_rate: float = 0.0
    ff_dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, decode: bool = False) -> jax.Array:
        del decode  # A dense block computes the same thing in every mode.
        h = Dense(self.d_ff, kernel_axes=(axes.MLP, axes.EMBED), dtype=self.dtype, name="wi")(x)
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.MLP))
        h = nn.Dropout(self.ff_dropout_rate, broadcast_dims=(-2,))(h, deterministic=deterministic)
        h = nn.relu(h)
        y = Dense(self.d_model, kernel_axes=(axes.EMBED, axes.MLP), dtype=self.dtype, name="wo")(h)
        return nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)


gin.register(FeedForward, module="terra.layers")
