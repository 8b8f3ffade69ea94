"""Low-rank SRU branch of the Terraformer feed-forward block (paper §4.3).

The paper adds a recurrence to every feed-forward block, made cheap by a low-rank bottleneck:
"we first project from d_model to a small dimension (32 in our experiments), then apply the
SRU, and then project back to d_model and add the result to the feedforward block."
The reference (``docs/design/reference_code.md`` §4.3, ``configurable_transformer.py:FeedForwardWithOptions``)
builds the branch as ``LayerNorm -> Dense(n) -> SRU(n) [x n_layers] -> Dense(d_model)``, with
its own LayerNorm and no dropout, and the caller adds it to the feed-forward output.

The SRU cell (``trax/layers/rnn.py:SRU``), input ``x_t`` in R^n::

  [r, f, y] = split(Dense(3n)(x))         r, f = sigmoid(r), sigmoid(f)
  c_t = f_t * c_{t-1} + (1 - f_t) * y_t    (c_0 = 0)
  h_t = c_t * r_t + x_t * (1 - r_t) * sqrt(3)

``c_t`` is a *linear* recurrence in ``c``: each step is the affine map ``c -> a_t c + b_t``
with ``a_t = f_t`` and ``b_t = (1 - f_t) y_t``. Affine maps compose associatively,
``(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2)``, so ``jax.lax.associative_scan`` computes all
``L`` carries in ``O(log L)`` depth instead of the reference's sequential ``Scan``. A start
carry ``c0`` (decoding) enters as ``c_t = A_t c0 + B_t`` with ``(A_t, B_t)`` the scanned prefix.

Masked positions (``mask == 0``) are the identity map ``(1, 0)``: they keep the previous carry.
This is the reference's portal mask in Terraformer predict mode (§4.7): on the first, padded
call over ``[enc_real, dec, zeros]`` the padding must not advance the state
(``res = mask * new + (1 - mask) * old`` in the monkey-patched ``ScanSRUCell``).
"""

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from terra.backends import RecurrentState, get_state, has_state, put_state
from terra.layers import axes
from terra.layers.dense import Dense
from terra.layers.normalization import LayerNorm

# Logical axis names (replicated by the default rules: n = 32 is small). The gate projection maps
# n to 3n; two names because Flax refuses one array naming the same axis twice.
SRU_UNITS = axes.SRU_UNITS
SRU_GATES = axes.SRU_GATES

# The reference's highway term scales the input by sqrt(3) (trax ``FinalSRUGate``).
_HIGHWAY_SCALE = math.sqrt(3.0)


def _compose(earlier, later):
    """Composition of affine maps ``c -> a c + b``: ``earlier`` applied first."""
    a1, b1 = earlier
    a2, b2 = later
    return a1 * a2, a2 * b1 + b2


def linear_recurrence(
    a: jax.Array, b: jax.Array, c0: Optional[jax.Array] = None, *, parallel: bool = True
) -> jax.Array:
    """All carries of ``c_t = a_t * c_{t-1} + b_t`` along axis 1.

    Args:
      a, b: ``[batch, length, n]``.
      c0: the carry before the first position, ``[batch, n]`` (zeros if ``None``).
      parallel: ``jax.lax.associative_scan`` (``O(log L)`` depth; the choice for
        accelerators) or a sequential ``jax.lax.scan`` over time (the reference's ``Scan``;
        the faster one on a CPU).
    Returns:
      ``c`` ``[batch, length, n]``, ``c[:, t]`` the carry after position ``t``.
    """
    if not parallel:
        start = jnp.zeros((a.shape[0], a.shape[2]), a.dtype) if c0 is None else c0

        def step(c, ab):
            c = ab[0] * c + ab[1]
            return c, c

        _, c = jax.lax.scan(step, start, (jnp.swapaxes(a, 0, 1), jnp.swapaxes(b, 0, 1)))
        return jnp.swapaxes(c, 0, 1)
    a_prefix, b_prefix = jax.lax.associative_scan(_compose, (a, b), axis=1)
    if c0 is None:
        return b_prefix
    return a_prefix * c0[:, None, :] + b_prefix


def _use_parallel_scan(parallel_scan: Optional[bool]) -> bool:
    # The sequential scan is the faster one on a CPU, by a whole Terraformer train step too
    # (docs/architecture.md); the associative scan's O(log L) depth pays on accelerators.
    if parallel_scan is None:
        return jax.default_backend() != "cpu"
    return parallel_scan


class SRU(nn.Module):
    """One SRU layer (``trax/layers/rnn.py:SRU``): ``[batch, length, n] -> [batch, length, n]``.

    The recurrence runs in float32 whatever ``dtype`` (the forget gate's cumulative product
    is what carries information over long spans). In decode mode the carry ``[batch, n]``
    is the ``cache`` variable ``carry``; it is created at zero by the cache-creating call
    (``init(..., decode=True)``) without being advanced, and every later call continues it.
    A cache-creating call given ``prefix_mask`` is a prefill: it runs the prefix (positions
    where the mask is 0 keep the carry) and stores the final carry.
    ``parallel_scan`` picks the associative or the sequential scan (``linear_recurrence``);
    ``None`` (the default) picks by backend: sequential on CPU, associative on accelerators.
    """

    dtype: jnp.dtype = jnp.float32
    parallel_scan: Optional[bool] = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        decode: bool = False,
        mask: Optional[jax.Array] = None,
        prefix_mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        batch, _, n = x.shape
        prefill = decode and prefix_mask is not None
        if prefill:
            mask = prefix_mask
        gates = Dense(3 * n, kernel_axes=(SRU_GATES, SRU_UNITS), dtype=self.dtype, name="gates")(x)
        r, f, y = jnp.split(gates.astype(jnp.float32), 3, axis=-1)
        r, f = jax.nn.sigmoid(r), jax.nn.sigmoid(f)
        a, b = f, (1.0 - f) * y
        if mask is not None:
            keep = (mask != 0)[..., None]  # [batch, length, 1]
            a = jnp.where(keep, a, 1.0)
            b = jnp.where(keep, b, 0.0)

        if decode:
            initialized = has_state(self, RecurrentState)
            carry = get_state(self, RecurrentState).carry if initialized else jnp.zeros((batch, n), jnp.float32)
            c = linear_recurrence(a, b, carry, parallel=_use_parallel_scan(self.parallel_scan))
            # A plain cache-creating call must not advance the state.
            put_state(self, RecurrentState(c[:, -1] if initialized or prefill else carry))
        else:
            c = linear_recurrence(a, b, parallel=_use_parallel_scan(self.parallel_scan))

        h = c * r + x.astype(jnp.float32) * (1.0 - r) * _HIGHWAY_SCALE
        return h.astype(self.dtype)


class LowRankSRU(nn.Module):
    """The paper's low-rank SRU branch: ``[batch, length, d_model] -> [batch, length, d_model]``.

    ``LayerNorm -> Dense(n_units) -> SRU(n_units) x n_layers -> Dense(d_model)``; the caller
    adds the result to the feed-forward block's output inside the same residual (§4.3).

    Attributes:
      d_model: model width (input and output features).
      n_units: the bottleneck and SRU width (32 in the paper and configs; 64 in the 54B
        timing template).
      n_layers: stacked SRU layers (the first entry of the reference's ``ff_use_sru``; 1).
      center_layernorm: LayerNorm (True) or RMSNorm (False) at the branch's input, the
        Terraformer's ``center_layernorm`` (the reference's ``FeedForwardWithOptions``).
      dtype: computation dtype (the recurrence itself is float32).
      parallel_scan: associative scan over the length (True), a sequential scan (False) or, by
        default (None), the faster of the two for the backend (sequential on CPU); the same
        function, see ``linear_recurrence``.

    Call ``(x, *, deterministic=True, decode=False, mask=None)``:
      mask: optional ``[batch, length]``; positions with 0 keep the previous carry (their own
        output is not meaningful). Used for the padded encoder part of Terraformer's
        concatenated decode prefix.
      decode: the carry lives in the ``cache`` collection; a call may hold a prefix of several
        tokens (prefill) or one token, and the carry continues across calls.
      deterministic: accepted for the injected-layer contract; the branch has no dropout.
    """

    d_model: int
    n_units: int = 32
    n_layers: int = 1
    center_layernorm: bool = True
    dtype: jnp.dtype = jnp.float32
    parallel_scan: Optional[bool] = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        deterministic: bool = True,
        decode: bool = False,
        mask: Optional[jax.Array] = None,
        prefix_mask: Optional[jax.Array] = None,
    ) -> jax.Array:
        del deterministic  # No dropout in the reference's SRU branch.
        h = LayerNorm(center=self.center_layernorm, dtype=self.dtype, name="norm")(x)
        h = Dense(self.n_units, kernel_axes=(SRU_UNITS, axes.EMBED), dtype=self.dtype, name="down")(h)
        h = nn.with_logical_constraint(h, (axes.BATCH, axes.LENGTH, SRU_UNITS))
        for i in range(self.n_layers):
            h = SRU(dtype=self.dtype, parallel_scan=self.parallel_scan, name=f"sru_{i}")(
                h, decode=decode, mask=mask, prefix_mask=prefix_mask
            )
        return Dense(self.d_model, kernel_axes=(axes.EMBED, SRU_UNITS), dtype=self.dtype, name="up")(h)
