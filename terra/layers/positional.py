"""Trainable positional embeddings initialised with sin/cos (reference ``tl.PositionalEncoding``).

``trax_reference.md`` §4.6: ``pos_type=None`` gives a trainable ``[max_len, d_model]`` table
initialised with ``sin/cos(pos * exp(-ln(10000) * 2i / d))``. In decode mode the next
position is kept in the ``cache`` collection.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from terra.layers import axes


def sinusoid_table(max_len: int, d_model: int) -> np.ndarray:
    """``[max_len, d_model]`` table; even features are sin, odd features are cos."""
    position = np.arange(max_len, dtype=np.float64)[:, None]
    div = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * -(np.log(10000.0) / d_model))
    table = np.zeros((max_len, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(position * div)
    table[:, 1::2] = np.cos(position * div)[:, : d_model // 2]
    return table.astype(np.float32)


class TrainablePositionalEmbedding(nn.Module):
    """Adds a learned positional vector: ``[batch, length, d_model] -> same``.

    In decode mode (one token per call) the position comes from the cache variable
    ``position``, created at 0 on the first (cache-creating) call and advanced per step.
    """

    max_len: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, decode: bool = False) -> jax.Array:
        length, d_model = x.shape[-2], x.shape[-1]

        def init(key, shape, dtype=jnp.float32):
            del key
            return jnp.asarray(sinusoid_table(*shape), dtype)

        table = self.param(
            "pos_embedding",
            nn.with_logical_partitioning(init, (axes.POSITIONS, axes.EMBED)),
            (self.max_len, d_model),
        )
        table = jnp.asarray(table, self.dtype)
        if not decode:
            if length > self.max_len:
                raise ValueError(
                    f"Sequence length {length} exceeds the positional table (max_len="
                    f"{self.max_len}); raise TransformerConfig.max_len or truncate the inputs."
                )
            return x + table[None, :length]
        initialized = self.has_variable("cache", "position")
        position = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
        if not initialized:
            # Cache-creating call: the output is discarded by the caller.
            return x + table[None, :length]
        pos = position.value
        position.value = pos + length
        return x + lax.dynamic_slice_in_dim(table, pos, length, axis=0)[None]
