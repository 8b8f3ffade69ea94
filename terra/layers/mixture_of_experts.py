"""Mixture-of-experts style feed-forward: the block-sparse baseline the paper compares with
(§3.1 "Mixture-of-Experts style sparsity"; reference ``BlockSparseFF``, ``docs/design/reference_code.md`` §1.4).

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
import jax
import jax.numpy as jnp

from terra.backends import as_float, output_major_product, take_rows
from terra.errors import ConfigError
from terra.layers import axes
from terra.layers.dense import BIAS_INIT, Dense
from terra.layers.initializers import glorot_uniform
from terra.layers.selection import (
    block_argmax,
    expected_distinct_choices,
    gumbel_block_argmax,
    straight_through_mask,
)


class MixtureOfExpertsFeedForward(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]`` (the feed-forward swap point).

    W1 and W2 are stored as ``[n_experts, d_ff / n_experts, d_model]`` so an expert's block is
    contiguous.
    """

    d_model: int
    d_ff: int
    dropout_rate: float = 0.0
    ff_dropout_rate: float = 0.0  # unused, as in the reference
    # The output dropout the reference appends after BlockSparseFF (dropout_shared_axes): one
    # mask per example shared over positions, or one per position (FeedForward's contract).
    share_dropout_over_length: bool = False
    dtype: jnp.dtype = jnp.float32
    n_experts: int = 64
    temperature: float = 0.7
    hard_prob: float = 0.5

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, decode: bool = False) -> jax.Array:
        if self.n_experts <= 0 or self.d_ff % self.n_experts:
            raise ConfigError(
                f"MixtureOfExpertsFeedForward: d_ff={self.d_ff} is not divisible by n_experts={self.n_experts}."
            )
        block = self.d_ff // self.n_experts
        shape, names = (self.n_experts, block, self.d_model), (axes.EXPERTS, axes.MLP, axes.EMBED)
        wi = self.param("wi", nn.with_logical_partitioning(glorot_uniform(self.d_model, self.d_ff), names), shape)
        wo = self.param("wo", nn.with_logical_partitioning(glorot_uniform(self.d_ff, self.d_model), names), shape)
        wo_bias = self.param("wo_bias", nn.with_logical_partitioning(BIAS_INIT, (axes.EMBED,)), (self.d_model,))
        logits = Dense(
            self.n_experts, kernel_axes=(axes.EXPERTS, axes.EMBED), use_bias=False, dtype=self.dtype, name="router"
        )(x).astype(jnp.float32)
        train = not deterministic
        if train:
            index = gumbel_block_argmax(logits, self.temperature, self.make_rng("dropout"))
        else:
            index = block_argmax(logits)
        x = x.astype(self.dtype)
        if decode:
            w_in = take_rows(wi, index).astype(self.dtype)  # [..., block, d_model]
            w_out = take_rows(wo, index).astype(self.dtype)
            h = nn.relu(jnp.einsum("...d,...fd->...f", x, w_in))
            y = jnp.einsum("...f,...fd->...d", h, w_out) + wo_bias
        else:
            if train:
                mask = straight_through_mask(logits, index, self.hard_prob, self.make_rng("dropout"))
            else:
                mask = jax.nn.one_hot(index, self.n_experts, dtype=jnp.float32)
            mid = output_major_product(x, as_float(wi, self.dtype).reshape(self.d_ff, self.d_model))
            mid = mid.reshape(mid.shape[:-1] + (self.n_experts, block)) * mask[..., None].astype(self.dtype)
            h = nn.relu(mid).reshape(mid.shape[:-2] + (self.d_ff,))
            y = h @ as_float(wo, self.dtype).reshape(self.d_ff, self.d_model) + wo_bias
        shared = axes.dropout_broadcast_dims(self.share_dropout_over_length)
        y = nn.Dropout(self.dropout_rate, broadcast_dims=shared)(y, deterministic=deterministic)
        return y.astype(self.dtype)

    @staticmethod
    def params_read_per_token(params, batch: int = 1) -> int:
        """Parameters one decode step of ``batch`` sequences reads: the router, the output bias,
        and the experts (blocks of W1 and W2) the sequences choose, their union read once:
        ``expected_distinct_choices(n_experts, batch)`` experts for sequences choosing
        independently and uniformly (one at batch 1). Rounded to a whole parameter."""
        n_experts, block, d_model = params["wi"].shape
        experts = expected_distinct_choices(n_experts, batch)
        return round(params["router"]["kernel"].size + 2 * experts * block * d_model + params["wo_bias"].size)
