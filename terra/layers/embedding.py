"""Token embedding and the dense output-logits layer.

As in the reference (trax ``ConfigurableTransformer``), input and output embeddings are
not tied: the logits layer has its own ``[vocab, d_model]`` kernel and a ``[vocab]`` bias.
The logits layer is a swap point: the sparse-loss (multiplicative) layer replaces it.
"""

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from terra.layers import axes
from terra.errors import ConfigError
from terra.layers.dense import Dense
from terra.layers.multiplicative import MultiplicativeDense


class TokenEmbedding(nn.Module):
    """``[batch, length] int -> [batch, length, d_model]``.

    Initialised like the reference's ``tl.Embedding`` (truncated normal, variance 1/d_model).
    """

    vocab_size: int
    d_model: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.variance_scaling(
            1.0, "fan_out", "truncated_normal", in_axis=-2, out_axis=-1
        )
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(init, (axes.VOCAB, axes.EMBED)),
            (self.vocab_size, self.d_model),
        )
        return jnp.take(jnp.asarray(table, self.dtype), tokens, axis=0)


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


gin.register(DenseLogits, module="terra.layers")


class MultiplicativeLogits(nn.Module):
    """The paper's sparse loss layer (§3.3, appendix 6.2): logits from a multiplicative layer
    ``d_model -> vocab`` with ``S = loss_sparsity`` modules; vocabulary id ``s·(V/S) + m``.
    ``[..., d_model] -> [..., vocab]`` (float32). Decode computes the same (small) layer."""

    vocab_size: int
    loss_sparsity: int = 4
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.loss_sparsity <= 0 or self.vocab_size % self.loss_sparsity:
            raise ConfigError(
                f"MultiplicativeLogits: vocab_size={self.vocab_size} is not divisible by loss_sparsity="
                f"{self.loss_sparsity}; choose S dividing the vocabulary (32000 allows 2, 4, 8)."
            )
        logits = MultiplicativeDense(
            self.vocab_size,
            self.loss_sparsity,
            kernel_axes=(axes.EMBED, axes.VOCAB),
            dtype=self.dtype,
            name="multiplicative",
        )(x)
        return logits.astype(jnp.float32)


gin.register(MultiplicativeLogits, module="terra.layers")
