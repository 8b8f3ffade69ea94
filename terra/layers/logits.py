"""The dense output-logits layer: ``[..., d_model] -> [..., vocab]``.

It has its own ``[vocab, d_model]`` kernel and a ``[vocab]`` bias (not tied to the token
embedding, as in the reference). It is a swap point: the sparse loss layer
(``terra.layers.sparse_loss.SparseLossLogits``) replaces it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.layers import axes
from terra.layers.dense import Dense


class DenseLogits(nn.Module):
    """Final projection to the vocabulary: ``[..., d_model] -> [..., vocab]`` (float32)."""

    vocab_size: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        logits = Dense(
            self.vocab_size,
            kernel_axes=(axes.VOCAB, axes.EMBED),
            dtype=self.dtype,
            name="dense",
        )(x)
        return logits.astype(jnp.float32)
