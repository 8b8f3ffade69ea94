"""Token embedding, shared by the encoder and the decoder.

As in the reference (trax ``ConfigurableTransformer``), input and output embeddings are not
tied: the output layer (``terra.layers.logits`` or ``terra.layers.sparse_loss``) has its own
weights.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import look_up_rows
from terra.layers import axes


class TokenEmbedding(nn.Module):
    """``[batch, length] int -> [batch, length, d_model]``.

    Initialised like the reference's ``tl.Embedding`` (truncated normal, variance 1/d_model).
    """

    vocab_size: int
    d_model: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.variance_scaling(1.0, "fan_out", "truncated_normal", in_axis=-2, out_axis=-1)
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(init, (axes.VOCAB, axes.EMBED)),
            (self.vocab_size, self.d_model),
        )
        return look_up_rows(table, tokens, self.dtype)  # a decode tree's rows widened with their own scales
