"""Layer normalisation (the reference's ``tl.LayerNorm``: centred, learned scale and bias)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.layers import axes


class LayerNorm(nn.Module):
    """Normalise the last axis: ``[..., d_model] -> [..., d_model]``.

    ``center=False`` gives RMSNorm (the reference's ``center_layernorm=False``).
    Statistics are computed in float32 whatever the compute dtype.
    """

    epsilon: float = 1e-6
    center: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x32 = x.astype(jnp.float32)
        if self.center:
            x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.epsilon)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (axes.EMBED,)), (d,))
        y = y * scale
        if self.center:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)), (d,))
            y = y + bias
        return y.astype(self.dtype)
