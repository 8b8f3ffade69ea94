"""Dense feed-forward block: the baseline at the paper's feed-forward swap point.

``docs/design/reference_code.md`` §4.3: ``Dense(d_ff) -> Dropout(ff_dropout) -> ReLU -> Dense(d_model)
-> Dropout(dropout)``; the ff dropout comes *before* the ReLU. The reference shares the ff
dropout's mask over the length axis always (``_FeedForward`` hard-codes ``shared_axes=[-2]``)
and the output dropout's only where the model asks (``dropout_shared_axes``: the Terraformer
does, ``ConfigurableTransformer`` by default does not). ``SparseFeedForward`` replaces this
module with one gin line.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.layers import axes
from terra.layers.dense import Dense


class FeedForward(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]``.

    Injected-layer contract (shared with the sparse variants): constructed with
    ``d_model, d_ff, dropout_rate, ff_dropout_rate, share_dropout_over_length, dtype``;
    called as ``(x, *, deterministic, decode)``. ``share_dropout_over_length``: one output
    dropout mask per example shared over positions (True) or one per position (False, the
    reference layer's default ``dropout_shared_axes=None``).
    """

    d_model: int
    d_ff: int
    dropout_rate: float = 0.0
    ff_dropout_rate: float = 0.0
    share_dropout_over_length: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, decode: bool = False) -> jax.Array:
        del decode  # A dense block computes the same thing in every mode.
        h = Dense(self.d_ff, kernel_axes=(axes.MLP, axes.EMBED), dtype=self.dtype, name="wi")(x)
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, axes.MLP))
        # Shared over length whatever the model asks: the reference's _FeedForward hard-codes it.
        h = nn.Dropout(self.ff_dropout_rate, broadcast_dims=(-2,))(h, deterministic=deterministic)
        h = nn.relu(h)
        y = Dense(self.d_model, kernel_axes=(axes.EMBED, axes.MLP), dtype=self.dtype, name="wo")(h)
        shared = axes.dropout_broadcast_dims(self.share_dropout_over_length)
        return nn.Dropout(self.dropout_rate, broadcast_dims=shared)(y, deterministic=deterministic)
