"""Weight initializers with explicit fans, shared by the layers whose stored shape is not the
``[in, out]`` matrix the reference initialises.

Kernels here are stored output-major or stacked (see ``terra.layers.dense``), so Flax's
shape-derived fans would be wrong; these take the fans of the matrix the reference draws.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


def glorot_uniform(fan_in: int, fan_out: int):
    """Glorot-uniform with explicit fans: feed-forward weights are initialised as the
    ``[d_model, d_ff]`` and ``[d_ff, d_model]`` matrices the reference draws, whatever their
    stored shape (e.g. ``[d_ff / N, N, d_model]`` for the sparse feed-forward)."""
    limit = (6.0 / (fan_in + fan_out)) ** 0.5

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -limit, limit)

    return init


def stacked_glorot_uniform():
    """Glorot-uniform for a fused ``[heads, n_stack, d_head, d_model]`` kernel: each of the
    stacked projections (Q, K, V) is initialised as its own ``[d_model -> heads * d_head]``
    matrix."""
    return nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=(3,), out_axis=(0, 2), batch_axis=(1,))


# XLA:CPU compiles the threefry hash behind every random draw (20 unrolled rounds) once per
# parameter, and its optimization passes make each copy several times costlier to compile, while the
# initializer runs once: up to INITIALIZER_UNOPTIMIZED_PARAMETERS the optimizations cost far more
# compile time than they save run time, at the paper's 800M widths the two are about even
# (docs/architecture.md, "Decisions taken from measurements"). Without them, values differ from an
# optimized compile's in their last bits (float32 rounding of the scaling).
INITIALIZER_UNOPTIMIZED_PARAMETERS = 50_000_000
UNOPTIMIZED = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_initializer(traced: jax.stages.Traced) -> jax.stages.Compiled:
    """An initializer's trace (``jax.jit(init).trace(rng)``) compiled, without XLA's optimization
    passes for a tree of at most :data:`INITIALIZER_UNOPTIMIZED_PARAMETERS` values."""
    size = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(traced.out_info))
    return traced.lower().compile(compiler_options=UNOPTIMIZED if size <= INITIALIZER_UNOPTIMIZED_PARAMETERS else None)
