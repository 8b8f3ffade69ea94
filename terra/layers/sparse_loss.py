"""The paper's sparse loss layer (§3.3; Table 7): the output logits from a multiplicative layer.

The dense ``d_model -> vocab`` projection is replaced by the multiplicative layer of Sparse
QKV (``terra.layers.multiplicative``) with ``S = loss_sparsity`` modules, so a decoded token
reads ``S·d + d·V/S`` weights instead of ``d·V``. The reference builds it the same way
(``loss_sparsity`` in ``ConfigurableTransformer``). A swap point for ``DenseLogits``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.multiplicative import MultiplicativeDense


class SparseLossLogits(nn.Module):
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
                f"SparseLossLogits: vocab_size={self.vocab_size} is not divisible by loss_sparsity="
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
