"""The multiplicative dense layer (paper §3.2; reference ``FactoredDense``, ``docs/design/reference_code.md`` §2.1).

  y[s, m] = sum_i x_i · D[s, i] · E[i, m] + b[s·M + m],   S modules of size M = d_out / S

It has ``S·d_in + d_in·d_out/S`` weights instead of ``d_in·d_out`` yet can represent any
permutation of its input (the paper's Theorem 1), so the sparse QKV layer uses it to let every
head see any part of the embedding, and the sparse loss uses it for the logits.
"""

import math
from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import as_float, input_major_product
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.dense import BIAS_INIT

# Rows of x from which the product runs with D folded into E (one kernel of d_in x d_out) instead of
# on S gated copies of each row: decode steps (a row or a few) keep the gated form, which reads
# only the S·d_in + d_in·M stored weights.
COMBINED_KERNEL_ROWS = 64


class MultiplicativeDense(nn.Module):
    """``[..., d_in] -> [..., features]``, or ``[..., S, M]`` with ``split_modules=True``.

    Attributes:
      features: d_out; must be divisible by ``n_modules``.
      n_modules: S.
      kernel_axes: logical names of E, stored input-major as ``[d_in, M]`` (for these narrow
        kernels XLA:CPU's product is faster in this layout than output-major; see
        ``docs/architecture.md``).
      gate_axes: logical names of D, stored as ``[S, d_in]`` (the paper's D transposed).
      use_bias: add ``b`` of shape ``[d_out]`` (on by default, as the reference).

    Initialisation as the reference: D ~ N(0, 0.5²), E Glorot-uniform with limit
    ``sqrt(6 / (d_in + M))``, b ~ N(0, 1e-6).
    """

    features: int
    n_modules: int
    kernel_axes: Tuple[str, str] = (axes.EMBED, axes.KV)
    gate_axes: Tuple[str, str] = (axes.MODULES, axes.EMBED)
    use_bias: bool = True
    split_modules: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.n_modules <= 0 or self.features % self.n_modules:
            raise ConfigError(
                f"MultiplicativeDense '{self.name}': output size {self.features} is not divisible by "
                f"S={self.n_modules} modules; choose S dividing {self.features}."
            )
        d_in = x.shape[-1]
        size = self.features // self.n_modules
        gate = self.param(
            "gate", nn.with_logical_partitioning(nn.initializers.normal(0.5), self.gate_axes), (self.n_modules, d_in)
        )
        limit = (6.0 / (d_in + size)) ** 0.5
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(
                lambda k, s, d=jnp.float32: jax.random.uniform(k, s, d, -limit, limit), self.kernel_axes
            ),
            (d_in, size),
        )
        x = x.astype(self.dtype)
        if math.prod(x.shape[:-1]) >= COMBINED_KERNEL_ROWS:
            # Many rows (a prefill, training): D folded into E once, K[i, s, m] = D[s, i] E[i, m],
            # and one [d_in, S·M] product, where the gated form multiplies S scaled copies of
            # every row (the same sums; XLA:CPU runs that product far below this one's rate at a
            # prefill's rows; docs/architecture.md).
            combined = as_float(gate, self.dtype).T[:, :, None] * as_float(kernel, self.dtype)[:, None, :]
            y = (x @ combined.reshape(d_in, -1)).reshape(x.shape[:-1] + (self.n_modules, size))
        else:
            gated = x[..., None, :] * as_float(gate, self.dtype)  # [..., S, d_in]
            y = input_major_product(gated, kernel)  # [..., S, M]
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(BIAS_INIT, (self.kernel_axes[1],)), (self.features,))
            y = y + jnp.asarray(bias, self.dtype).reshape(self.n_modules, size)
        return y if self.split_modules else y.reshape(y.shape[:-2] + (self.features,))

    def stored_weights(self):
        """``(D, E, b)`` as the parameters store them (float, or a decode tree's narrow weights), for
        a layer that hands its weights to a backend's fused decode step; ``None`` for any not yet
        created."""
        return tuple(nn.unbox(self.get_variable("params", name)) for name in ("gate", "kernel", "bias"))
