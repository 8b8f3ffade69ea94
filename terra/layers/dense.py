"""Dense projection with logical axis names and an output-major kernel layout.

The kernel is stored as ``[*features, *in_features]`` (output axes first). Batch-1 decoding
on CPU is a matrix-vector product per layer and is bound by how fast the weights stream
from memory; XLA:CPU reads the output-major layout faster than Flax's ``[in, out]``
(``docs/design/cpu_decoding.md``). Storing the kernel that way means no transpose is ever
materialised in the step.
"""

import math
from typing import Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import output_major_product

Features = Union[int, Sequence[int]]

# The reference initialises biases with N(0, 1e-6) (trax Dense default).
BIAS_INIT = nn.initializers.normal(stddev=1e-6)


def _as_tuple(features: Features) -> Tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


class Dense(nn.Module):
    """``y[..., *features] = sum_in x[..., *in] * kernel[*features, *in] + bias[*features]``.

    Attributes:
      features: output size, an int or a tuple (e.g. ``(n_heads, d_head)``).
      kernel_axes: logical names of the kernel, output axes first then input axes;
        its length must equal ``len(features) + n_contract``.
      n_contract: how many trailing input axes are contracted (2 to merge heads).
      use_bias: add a bias of shape ``features`` (named by the output kernel axes).
      dtype: computation dtype; parameters are kept in ``param_dtype``.

    Input ``[..., *in]``, output ``[..., *features]``. The first output axis should be the
    one a model-parallel rule shards (e.g. heads), so that merging the output axes for the
    2-D product below stays a local reshape under sharding.
    """

    features: Features
    kernel_axes: Tuple[str, ...]
    n_contract: int = 1
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_init: nn.initializers.Initializer | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = _as_tuple(self.features)
        n_out, n_in = len(features), self.n_contract
        if len(self.kernel_axes) != n_out + n_in:
            raise ValueError(
                f"Dense '{self.name}': kernel_axes={self.kernel_axes} must name "
                f"{n_out} output axes {features} and {n_in} input axes."
            )
        in_shape = x.shape[x.ndim - n_in :]
        # Glorot-uniform as the reference (trax Dense), with fans over the
        # output-major layout.
        init = self.kernel_init or nn.initializers.variance_scaling(
            1.0,
            "fan_avg",
            "uniform",
            in_axis=tuple(range(n_out, n_out + n_in)),
            out_axis=tuple(range(n_out)),
        )
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.kernel_axes),
            features + in_shape,
            self.param_dtype,
        )
        # Contract as one 2-D product ``[..., in] x [out, in]^T``: the row-major reshapes
        # are free, and XLA:CPU then reads the kernel in place. Given a multi-axis kernel
        # directly, its dot canonicaliser transposes the kernel to ``[in, out]`` and copies
        # it on every call, which dominates batch-1 decoding (docs/architecture.md).
        # A decode tree's narrow kernel is read by the backend as it is stored.
        x2 = x.astype(self.dtype).reshape(x.shape[: x.ndim - n_in] + (math.prod(in_shape),))
        y = output_major_product(x2, kernel).reshape(x.shape[: x.ndim - n_in] + features)
        if self.use_bias:
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(BIAS_INIT, self.kernel_axes[:n_out]),
                features,
                self.param_dtype,
            )
            y = y + jnp.asarray(bias, self.dtype)
        return y

    def stored_weights(self):
        """The kernel as the parameters store it (float, or a decode tree's narrow weights), for a
        layer that hands its weights to a backend's fused decode step; ``None`` before it exists."""
        return nn.unbox(self.get_variable("params", "kernel"))
