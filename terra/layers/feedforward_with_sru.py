"""Terraformer's feed-forward block: a feed-forward layer plus the low-rank SRU branch.

Paper §4.3; reference ``configurable_transformer.py:FeedForwardWithOptions``
(``docs/design/reference_code.md`` §4.3): ``f(x) = [LN -> FF -> Dropout](x) + [LN -> Dense(32) -> SRU(32)
-> Dense(d)](x)``, both branches inside the same (half-)residual, each with its own norm.
The feed-forward layer is injected (dense ``FeedForward`` or ``SparseFeedForward``; it ends
with its own dropout).
"""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.layers.normalization import LayerNorm
from terra.layers.sru import LowRankSRU


class FeedForwardWithSRU(nn.Module):
    """``[batch, length, d_model] -> [batch, length, d_model]``: ``FF(LN(x)) + SRU-branch(x)``.

    Attributes:
      feed_forward: the feed-forward module, called ``(h, deterministic=, decode=[, indices=])``.
      d_model: model width.
      sru_units: SRU bottleneck width (32 in the paper); 0 drops the branch.
      sru_layers: stacked SRU layers in the branch (1).
      center_layernorm: LayerNorm (True) or RMSNorm (False) before the feed-forward and in the SRU
        branch.

    ``indices`` replays a sparse feed-forward's block choices (reversible recomputation) and
    the ones used are sown as ``intermediates/indices``, so ``HalfResidual(...,
    decisions_kwarg='indices')`` can store them. ``prefix_mask`` marks a decode prefill (the
    SRU stores its carry after the prefix's real tokens; the feed-forward then runs its
    full-sequence path, which equals the row-gathering decode path on every token but does
    not materialise gathered weights per token of a long prefix).
    """

    feed_forward: nn.Module
    d_model: int
    sru_units: int = 32
    sru_layers: int = 1
    center_layernorm: bool = True
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        prefix_mask: Optional[jax.Array] = None,
        indices: Optional[jax.Array] = None,
    ) -> jax.Array:
        h = LayerNorm(center=self.center_layernorm, dtype=self.dtype, name="norm")(x)
        replay = {} if indices is None else {"indices": indices}
        y = self.feed_forward(h, deterministic=deterministic, decode=decode and prefix_mask is None, **replay)
        sown = self.feed_forward.variables.get("intermediates", {}).get("indices")
        if sown is not None:
            self.sow("intermediates", "indices", sown[-1])
        if self.sru_units:
            sru = LowRankSRU(
                self.d_model,
                self.sru_units,
                self.sru_layers,
                center_layernorm=self.center_layernorm,
                dtype=self.dtype,
                name="sru",
            )
            y = y + sru(x, deterministic=deterministic, decode=decode, prefix_mask=prefix_mask).astype(y.dtype)
        return y
