"""Two-stream reversible residual stack (RevNet; paper §4.2, ``docs/design/reference_code.md`` §4.2–4.4).

A stack of half-residuals ``f_0 .. f_{n-1}`` over two streams ``(x1, x2)``, each
``[batch, length, d_model]``. Layer ``i`` computes

  x1 <- x1 + f_i(x2);  swap          i.e.  (x1, x2) -> (x2, x1 + f_i(x2))

and is inverted exactly (up to rounding) by ``x1 = y2 - f_i(y1)``, ``x2 = y1``. The backward
pass therefore does not need the activations of the forward pass: it starts from the stack's
outputs, walks the layers in reverse, recomputes each ``f_i`` under ``jax.vjp`` on the
reconstructed input and rebuilds that layer's input from its output. Activation memory is
that of one layer plus the two output streams, whatever the depth (the reference's
``ReversibleHalfResidual.reverse_and_grad``); the gradient's temporaries grow far less per
layer than with plain autodiff (what remains is a parameter broadcast XLA materialises per
layer; ``terra-bench memory`` measures both). The reconstruction is exact up to rounding: keep the streams in
float32 (bfloat16 streams lose low bits on every ``(x + f) - f``).

The Terraformer decoder block is three half-residuals with a swap after each
(``x1 += Attn1(LN(x2)); swap; x2 += Attn2(LN(x1)); swap; x1 += FFN(x2); swap``), so a decoder
stack is ``ReversibleStack([attn1, attn2, ffn] * n_layers)``.

**Discrete decisions are stored, never recomputed** (paper §4.2, ``docs/design/reference_code.md`` §4.4).
The reconstructed input differs from the forward input by rounding; an argmax over a near
tie (the sparse feed-forward's block choice, LSH buckets) can flip on it, and the recomputed
``f_i`` would then be a different function from the one the forward pass applied: the
rebuilt activations and the gradients would be wrong. So a half-residual returns its
integer decisions with its output, the stack keeps them (they are small int arrays) as
residuals of the custom VJP, and the reverse pass calls the layer again *with* them.

Half-residual protocol (a Flax module)::

    __call__(x, *context, decisions=None, deterministic=True, **kwargs) -> (y, decisions)

  x          [batch, length, d_model], the stream the layer reads.
  context    the stack's extra positional arguments, passed unchanged to every layer
             (e.g. an attention mask); differentiable where floating point.
  decisions  None in the forward pass: the layer makes its choices and returns them (a
             pytree of arrays, or None if it makes none). In the reverse pass: exactly what
             it returned, and the layer must use it instead of deciding again.
  kwargs     the stack's static keyword arguments (``decode``, ``max_decode_length``...).
  y          [batch, length, d_model], added to the other stream.

``HalfResidual`` adapts an ordinary layer (attention, feed-forward) to the protocol: optional
pre-LayerNorm, the layer, optional output dropout, and the decisions read from what the
layer sows (``SparseFeedForward`` sows ``intermediates/indices`` and replays ``indices=``).

**Randomness.** Both passes must draw the same dropout masks (and Gumbel noise, hash
rotations...). The stack therefore draws one key per layer per rng stream explicitly and
applies each layer as a pure function of ``(params, x, context, decisions, keys)``; the
reverse pass re-applies it with the same keys. A layer must consume its rngs in the same order
whether or not ``decisions`` is given for the two passes to agree (``SparseFeedForward``
draws its Gumbel key even when it is given ``indices``, for this reason).

**Modes.** ``reversible=True`` (default) uses the custom VJP; ``reversible=False`` runs the
same pure layer functions with the same keys under ordinary autodiff (same values, same
gradients, activations stored: faster, more memory). While initialising, and when a state
collection such as ``cache`` is mutable (decoding), the layers run as ordinary bound Flax
modules: a custom-VJP function cannot write module state, and no gradient is taken there.
"""

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from terra.layers import axes
from terra.layers.normalization import LayerNorm

# A pytree of (integer) arrays a half-residual returns and must be able to replay.
Decisions = Any
# Per layer: {rng stream name: key} used in both passes.
LayerKeys = dict


class HalfResidual(nn.Module):
    """Adapts a layer to the half-residual protocol: ``x -> (Dropout(layer(LN(x))), decisions)``.

    ``[batch, length, d_model] -> ([batch, length, d_model], decisions)``.

    Attributes:
      layer: the wrapped module (pass it unbound or let the stack copy it); called as
        ``layer(h, *context?, deterministic=?, decisions_kwarg=decisions?, **kwargs)``.
      pre_norm: apply a LayerNorm first (the reference's ``ReversibleHalfResidual(LayerNorm,
        attention)``; a feed-forward with its own norm leaves this off).
      center_layernorm: LayerNorm (True) or RMSNorm (False).
      dropout_rate: output dropout (0 = none).
      share_dropout_over_length: one output-dropout mask per example shared over positions
        (``broadcast_dims=(-2,)``, default) or one per position.
      decisions_kwarg: the keyword the layer replays its decisions with and the name it sows
        them under in ``intermediates`` (``"indices"`` for ``SparseFeedForward``); None for a
        layer without discrete decisions.
      pass_context: give the stack's positional context (e.g. the encoder mask) to the layer.
      pass_kwargs: names of the stack's keyword arguments the layer accepts;
        ``deterministic`` is forwarded when listed (the default).
    """

    layer: nn.Module
    pre_norm: bool = True
    center_layernorm: bool = True
    dropout_rate: float = 0.0
    share_dropout_over_length: bool = True
    decisions_kwarg: Optional[str] = None
    pass_context: bool = False
    pass_kwargs: Tuple[str, ...] = ("deterministic",)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *context, decisions: Decisions = None, deterministic: bool = True, **kwargs):
        h = LayerNorm(center=self.center_layernorm, dtype=self.dtype, name="norm")(x) if self.pre_norm else x
        kwargs = dict(kwargs, deterministic=deterministic)
        call_kwargs = {k: v for k, v in kwargs.items() if k in self.pass_kwargs}
        if self.decisions_kwarg is not None and decisions is not None:
            call_kwargs[self.decisions_kwarg] = decisions
        y = self.layer(h, *(context if self.pass_context else ()), **call_kwargs)
        if self.decisions_kwarg is not None and decisions is None:
            # The layer sows its choice; readable when ``intermediates`` is mutable, which the
            # stack guarantees on its reversible path (elsewhere nobody replays them).
            sown = self.layer.variables.get("intermediates", {}).get(self.decisions_kwarg)
            decisions = None if sown is None else sown[-1]
        shared = axes.dropout_broadcast_dims(self.share_dropout_over_length)
        y = nn.Dropout(self.dropout_rate, broadcast_dims=shared)(y, deterministic=deterministic)
        return y, decisions


HalfResidualLike = Union[nn.Module, Callable[[], nn.Module]]


def _accumulate(total, new):
    """Adds cotangent trees; integer inputs have ``float0`` cotangents, which stay as they are."""
    return jax.tree.map(lambda a, b: a if b.dtype == jax.dtypes.float0 else a + b, total, new)


def _depends_on(x: jax.Array, tree) -> jax.Array:
    """``x`` unchanged, but data-dependent on every floating leaf of ``tree``, so the
    scheduler computes ``tree`` before anything that reads the result. ``0 * s`` is not folded
    for floating point (it is NaN for a non-finite ``s``, which the trainer's non-finite
    guard catches anyway)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not leaves:
        return x
    total = sum(jnp.sum(leaf[(0,) * leaf.ndim]) if leaf.ndim else leaf for leaf in leaves)
    return x + (total * 0).astype(x.dtype)


def _keys_after(keys: LayerKeys, x: jax.Array) -> LayerKeys:
    """The same rng keys, but data-dependent on ``x`` (they change only if ``x`` holds a NaN,
    when every result is NaN anyway): a layer's random bits (dropout masks) are then drawn
    when the layer runs, instead of being hoisted and kept alive across the whole pass."""
    poisoned = jnp.isnan(x.reshape(-1)[0])

    def after(key):
        data = jax.random.key_data(key)
        return jax.random.wrap_key_data(jnp.where(poisoned, data + 1, data), impl=jax.random.key_impl(key))

    return {name: after(key) for name, key in keys.items()}


def _zero_cotangent(x):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(jnp.shape(x), jax.dtypes.float0)


LayerFn = Callable[[Any, jax.Array, tuple, Decisions, LayerKeys], Tuple[jax.Array, Decisions]]


def reversible_forward(fns: Sequence[LayerFn], params, keys, context, x1, x2):
    """The stack's function: ``(x1, x2) -> (y1, y2), decisions`` (one entry per layer).

    ``fns[i](params[i], x, context, decisions, keys[i]) -> (y, decisions)`` are pure.
    """
    decisions = []
    for fn, p, k in zip(fns, params, keys):
        # The barrier ties the layer's params to its input, so XLA cannot hoist work that only
        # depends on params (materialised bias/scale broadcasts on CPU) to the start of the
        # program and keep one such activation-sized buffer per layer alive.
        p, k, x2 = jax.lax.optimization_barrier((p, k, x2))
        y, d = fn(p, x2, context, None, _keys_after(k, x2))
        x1, x2 = x2, x1 + y.astype(x1.dtype)
        decisions.append(d)
    return (x1, x2), tuple(decisions)


def reversible_inverse(fns: Sequence[LayerFn], params, keys, context, decisions, y1, y2):
    """``(y1, y2) -> (x1, x2)``, the inverse of ``reversible_forward`` given its decisions."""
    for i in reversed(range(len(fns))):
        fx, _ = fns[i](params[i], y1, context, decisions[i], keys[i])
        y1, y2 = y2 - fx.astype(y2.dtype), y1
    return y1, y2


def reversible_apply(fns: Sequence[LayerFn], params, keys, context, x1, x2):
    """``reversible_forward`` with a backward pass that rebuilds activations from the outputs.

    Residuals kept for the backward pass: the two output streams, the decisions, and the
    inputs the caller holds anyway (params, keys, context); nothing per layer but decisions.
    Returns ``((y1, y2), decisions)``; decisions carry no gradient.
    """

    @jax.custom_vjp
    def run(params, keys, context, x1, x2):
        return reversible_forward(fns, params, keys, context, x1, x2)

    def run_fwd(params, keys, context, x1, x2):
        (y1, y2), decisions = reversible_forward(fns, params, keys, context, x1, x2)
        return ((y1, y2), decisions), (params, keys, context, y1, y2, decisions)

    def run_bwd(residuals, cotangents):
        params, keys, context, y1, y2, decisions = residuals
        (g1, g2), _ = cotangents  # decisions are integers: no cotangent
        g_params = [None] * len(fns)
        g_context = jax.tree.map(_zero_cotangent, context)
        for i in reversed(range(len(fns))):
            # Layer i mapped (x1, x2) -> (y1, y2) = (x2, x1 + f(x2)): its input stream is y1.
            def f(p, x, c, k, i=i, dtype=y2.dtype):
                y, _ = fns[i](p, x, c, decisions[i], k)  # stored decisions, same keys
                return y.astype(dtype)

            # Nothing of layer i is computed before its input exists and layer i + 1's
            # backward step is done. The barrier keeps parameter-only work (and the dropout
            # masks, which would otherwise be common subexpressions of the forward pass's)
            # from being hoisted; the data dependency below orders the layers (XLA:CPU drops
            # barriers before scheduling, and its scheduler otherwise rebuilds every layer
            # first and defers the parameter-gradient matmuls to the end, keeping every
            # layer's activations alive: depth-linear memory again).
            p, k, y1 = jax.lax.optimization_barrier((params[i], keys[i], y1))
            k = _keys_after(k, y1)
            fx, vjp = jax.vjp(lambda p, x, c, k=k: f(p, x, c, k), p, y1, context)
            x1 = y2 - fx  # reconstruct the stream the layer added to
            gp, gx, gc = vjp(g2)
            g_params[i] = gp
            g_context = _accumulate(g_context, gc)
            # d/dx1 = g2 (x1 reached y2 unchanged); d/dx2 = g1 (x2 became y1) + f's input grad.
            g1, g2 = g2, g1 + gx.astype(g1.dtype)
            y1, y2 = _depends_on(x1, gp), y1
        g_keys = jax.tree.map(lambda _: None, keys)
        return tuple(g_params), g_keys, g_context, g1, g2

    run.defvjp(run_fwd, run_bwd)
    return run(tuple(params), tuple(keys), tuple(context), x1, x2)


class ReversibleStack(nn.Module):
    """``(x1, x2) -> (y1, y2)``, each ``[batch, length, d_model]``: half-residuals with a swap
    after each, ``x1 += f_i(x2); (x1, x2) = (x2, x1)``.

    Attributes:
      half_residuals: the layers in order, each following the half-residual protocol (see the
        module docstring; ``HalfResidual`` adapts ordinary layers). Either modules, which the
        stack copies into its own scope (so constructing them inside another module's
        ``setup``/``compact`` is fine), or zero-argument factories. Their parameters live
        under ``layer_0``, ``layer_1``, ...
      reversible: True: custom VJP rebuilding activations in the backward pass (memory
        independent of depth). False: ordinary autodiff of the same function.
      rng_collections: rng streams the layers use; for each one available in this call one
        key is drawn and split per layer, and each layer gets the same key in both passes.
      state_collections: collections the layers write outside training (the decode cache).
        When one is mutable, the layers run as ordinary Flax submodules (no custom VJP).

    ``__call__(x1, x2, *context, deterministic=True, **kwargs)``: ``context`` (positional
    arrays, e.g. a mask) and ``kwargs`` (static values, e.g. ``decode=True``) are passed to
    every layer. Each layer's decisions are sown as ``intermediates/decisions`` (a tuple,
    one entry per layer) on the pure paths.
    """

    half_residuals: Sequence[HalfResidualLike]
    reversible: bool = True
    rng_collections: Tuple[str, ...] = ("dropout",)
    state_collections: Tuple[str, ...] = ("cache",)

    def setup(self):
        layers = []
        for i, h in enumerate(self.half_residuals):
            name = f"layer_{i}"
            # A deep copy into this scope: a module built in the caller's compact context is
            # bound to the caller, and its parameters must live here for the pure path.
            layers.append(h.copy(name=name) if isinstance(h, nn.Module) else h().copy(name=name))
        self.layers = layers

    def __call__(self, x1: jax.Array, x2: jax.Array, *context, deterministic: bool = True, **kwargs):
        if self.is_initializing() or any(self.is_mutable_collection(c) for c in self.state_collections):
            for layer in self.layers:
                y, _ = layer(x2, *context, decisions=None, deterministic=deterministic, **kwargs)
                x1, x2 = x2, x1 + y.astype(x1.dtype)
            return x1, x2

        fns, params, keys = self._pure_parts(deterministic, kwargs)
        run = reversible_apply if self.reversible else reversible_forward
        (y1, y2), decisions = run(fns, params, keys, tuple(context), x1, x2)
        self.sow("intermediates", "decisions", decisions)
        return y1, y2

    def inverse(self, y1: jax.Array, y2: jax.Array, *context, decisions=None, deterministic: bool = True, **kwargs):
        """``(y1, y2) -> (x1, x2)``: the stack's inputs rebuilt from its outputs, as the backward
        pass does. ``decisions``: the tuple ``__call__`` sowed (``None``: every layer decides
        again, exact only without discrete choices); pass the same rngs as to ``__call__``."""
        fns, params, keys = self._pure_parts(deterministic, kwargs)
        decisions = (None,) * len(fns) if decisions is None else tuple(decisions)
        return reversible_inverse(fns, params, keys, tuple(context), decisions, y1, y2)

    def _pure_parts(self, deterministic: bool, kwargs: dict):
        """Per layer: the pure function, its (unboxed) params and its rng keys. The keys are
        drawn first thing in the call, so ``inverse`` with the same rngs gets the same ones."""
        n = len(self.layers)
        streams = {c: jax.random.split(self.make_rng(c), n) for c in self.rng_collections if self.has_rng(c)}
        keys = [{c: k[i] for c, k in streams.items()} for i in range(n)]
        all_params = meta.unbox(self.variables.get("params", {}))
        params = [all_params.get(layer.name, {}) for layer in self.layers]
        fns = [self._pure(layer, deterministic, kwargs) for layer in self.layers]
        return fns, params, keys

    @staticmethod
    def _pure(layer: nn.Module, deterministic: bool, kwargs: dict) -> LayerFn:
        """``layer`` as a pure function of its params: ``(params, x, context, decisions, keys)
        -> (y, decisions)``. ``intermediates`` is mutable so ``HalfResidual`` can read what the
        wrapped layer sows; the collection itself is dropped."""
        template = layer.clone(parent=None, _deep_clone=True)

        def fn(params, x, context, decisions, keys):
            (y, d), _ = template.apply(
                {"params": params},
                x,
                *context,
                decisions=decisions,
                deterministic=deterministic,
                rngs=keys,
                mutable=["intermediates"],
                **kwargs,
            )
            return y, d

        return fn
