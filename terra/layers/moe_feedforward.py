"""Mixture-of-experts style feed-forward: the block-sparse baseline the paper compares with
(§3.1 "Mixture-of-Experts style sparsity"; reference ``BlockSparseFF``, ``trax_reference.md`` §1.4).

A dense router picks one of ``n_experts`` contiguous blocks of ``d_ff / n_experts`` units per
token; only that block is active:

  train:  idx = argmax(log_softmax(x·R) + temperature·Gumbel); straight-through one-hot on
          half of the calls, the softmax on the other half
  eval:   idx = argmax(x·R)
  out     = relu((x·W1) ⊙ mask) · W2 + b2
  decode: read only the chosen block of W1 and W2.

The reference also adds Gumbel noise in eval and predict; here eval and decode are
deterministic so that decoding equals evaluation.
"""

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.dense import BIAS_INIT, Dense
from terra.layers.sparse_feedforward import _glorot_for


class BlockSparseFeedForward(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]`` (the feed-forward swap point).

    W1 and W2 are stored as ``[n_experts, d_ff / n_experts, d_model]`` so an expert's block is
    contiguous.
    """

    d_model: int
    d_ff: int
    dropout_rate: float = 0.0
    ff_dropout_rate: float = 0.0  # unused, as in the reference
    dtype: jnp.dtype = jnp.float32
    n_experts: int = 64
    temperature: float = 0.7
    hard_prob: float = 0.5

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, decode: bool = False) -> jax.Array:
        if self.n_experts <= 0 or self.d_ff % self.n_experts:
            raise ConfigError(
                f"BlockSparseFeedForward: d_ff={self.d_ff} is not divisible by n_experts={self.n_experts}."
            )
        block = self.d_ff // self.n_experts
        shape, names = (self.n_experts, block, self.d_model), (axes.EXPERTS, axes.MLP, axes.EMBED)
        wi = self.param("wi", nn.with_logical_partitioning(_glorot_for(self.d_model, self.d_ff), names), shape)
        wo = self.param("wo", nn.with_logical_partitioning(_glorot_for(self.d_ff, self.d_model), names), shape)
        wo_bias = self.param("wo_bias", nn.with_logical_partitioning(BIAS_INIT, (axes.EMBED,)), (self.d_model,))
        logits = Dense(
            self.n_experts, kernel_axes=(axes.EXPERTS, axes.EMBED), use_bias=False, dtype=self.dtype, name="router"
        )(x).astype(jnp.float32)
        train = not deterministic
        if train:
            gumbel = jax.random.gumbel(self.make_rng("dropout"), logits.shape, jnp.float32)
            index = jnp.argmax(jax.nn.log_softmax(logits) + self.temperature * gumbel, axis=-1)
        else:
            index = jnp.argmax(logits, axis=-1)
        x = x.astype(self.dtype)
        if decode:
            w_in = jnp.take(wi, index, axis=0, mode="clip").astype(self.dtype)  # [..., block, d_model]
            w_out = jnp.take(wo, index, axis=0, mode="clip").astype(self.dtype)
            h = nn.relu(jnp.einsum("...d,...fd->...f", x, w_in))
            y = jnp.einsum("...f,...fd->...d", h, w_out) + wo_bias
        else:
            mask = jax.nn.one_hot(index, self.n_experts, dtype=jnp.float32)
            if train:
                soft = jax.nn.softmax(logits, axis=-1)
                hard = jax.lax.stop_gradient(mask) + soft - jax.lax.stop_gradient(soft)
                use_hard = jax.random.uniform(self.make_rng("dropout"), ()) < self.hard_prob
                mask = jnp.where(use_hard, hard, soft)
            w_in = jnp.asarray(wi, self.dtype).reshape(self.d_ff, self.d_model)
            mid = jax.lax.dot_general(x, w_in, (((x.ndim - 1,), (1,)), ((), ())))
            mid = mid.reshape(mid.shape[:-1] + (self.n_experts, block)) * mask[..., None].astype(self.dtype)
            h = nn.relu(mid).reshape(mid.shape[:-2] + (self.d_ff,))
            y = h @ jnp.asarray(wo, self.dtype).reshape(self.d_ff, self.d_model) + wo_bias
        y = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(y, deterministic=deterministic)
        return y.astype(self.dtype)

    @staticmethod
    def params_read_per_token(params) -> int:
        n_experts, block, d_model = params["wi"].shape
        return params["router"]["kernel"].size + 2 * block * d_model + params["wo_bias"].size


gin.register(BlockSparseFeedForward, module="terra.layers")
