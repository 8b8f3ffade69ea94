"""Reversible residual stack: the custom backward pass rebuilds activations from outputs and
gives the gradients of plain autodiff, replays stored discrete decisions and dropout keys, and
its activation memory does not grow with depth."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.layers.attention import CausalSelfAttention, SelfAttention
from terra.layers.feedforward import FeedForward
from terra.layers.reversible import HalfResidual, ReversibleStack
from terra.layers.sparse_feedforward import SparseFeedForward

from cheap_init_prng import init_key

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D, FF = 16, 32
BATCH, LENGTH = 2, 6


def mlp_half(rate=0.0):
    return HalfResidual(FeedForward(D, FF, dropout_rate=rate, ff_dropout_rate=rate), dropout_rate=rate)


def sparse_half(rate=0.0, **kwargs):
    ff = SparseFeedForward(D, FF, ff_sparsity=4, dropout_rate=rate, **kwargs)
    return HalfResidual(ff, decisions_kwarg="indices", pass_kwargs=("deterministic", "decode"))


def attention_half(rate=0.0):
    return HalfResidual(SelfAttention(D, n_heads=2, dropout_rate=rate), dropout_rate=rate, pass_context=True)


def streams(seed=0, length=LENGTH):
    x = np.random.default_rng(seed).standard_normal((2, BATCH, length, D), np.float32)
    return jnp.asarray(x[0]), jnp.asarray(x[1])


def padding_mask():
    return jnp.array([[1] * LENGTH, [1] * (LENGTH - 2) + [0, 0]], jnp.int32)


def fast_jit(fn):
    """``jax.jit`` without LLVM's backend optimisations: these programs run once, and their
    compile time is most of this file's run time (~40% less at level 0)."""
    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})


def key(seed):
    """RBG keys: XLA:CPU compiles their random bits much faster than threefry's, which
    dominates the compile time of these small dropout-heavy programs."""
    return jax.random.key(seed, impl="rbg")


def init(stack, *args):
    """Jitted ``stack.init`` (eager init dispatches and compiles op by op: far slower), from a key
    whose initializer compiles in a third of the time (cheap_init_prng; dropout keys stay RBG)."""
    return fast_jit(stack.init)(init_key(1), *args)


@pytest.fixture(scope="module")
def three_layer_variables():
    """The variables of the attention / sparse feed-forward / feed-forward stack over ``streams()``
    and ``padding_mask()``, initialised once for the module: dropout rates, Gumbel temperature,
    quantisation probability and feed-forward chunking change no parameter, so every test of that
    stack reads these same values (from the same key)."""
    x1, x2 = streams()
    return init(ReversibleStack([attention_half(), sparse_half(), mlp_half()]), x1, x2, padding_mask())


def loss_and_grads_fn(stack, argnums=(0, 1, 2), deterministic=True):
    """Jitted ``(params, x1, x2, *context, rngs) -> (loss, grads)``: a loss with non-trivial
    cotangents on both output streams; grads w.r.t. the params, the two input streams (and,
    with ``argnums``, the context)."""
    w1, w2 = streams(seed=99)

    def loss(params, x1, x2, *context, rngs):
        y1, y2 = stack.apply({"params": params}, x1, x2, *context, deterministic=deterministic, rngs=rngs)
        return jnp.sum(y1 * w1) + jnp.sum(jnp.tanh(y2) * w2)

    return fast_jit(jax.value_and_grad(loss, argnums))


def loss_and_grads(stack, variables, x1, x2, *context, argnums=(0, 1, 2), rngs=None, deterministic=True):
    fn = loss_and_grads_fn(stack, argnums, deterministic)
    return fn(variables["params"], x1, x2, *context, rngs=rngs or {})


def assert_trees_close(a, b, atol=1e-5, rtol=1e-5):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and leaves_a
    for u, v in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=rtol)


def max_abs_diff(a, b):
    """On the host: an eager ``jnp`` reduction would compile one program per leaf shape."""
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def unboxed(tree):
    return nn.meta.unbox(tree)


@pytest.mark.slow
def test_reversible_gradients_equal_plain_autodiff_gradients(three_layer_variables):
    halves = [attention_half(), sparse_half(), mlp_half()]
    x1, x2 = streams()
    mask = padding_mask()
    reversible = ReversibleStack(halves)
    variables = three_layer_variables
    loss_r, grads_r = loss_and_grads(reversible, variables, x1, x2, mask)
    loss_p, grads_p = loss_and_grads(ReversibleStack(halves, reversible=False), variables, x1, x2, mask)
    np.testing.assert_allclose(loss_r, loss_p, rtol=1e-6)
    assert_trees_close(grads_r, grads_p)
    # Every layer's parameters receive gradient, the sparse feed-forwards' included (in eval
    # mode its controller gets none: the one-hot mask has no straight-through path).
    assert set(grads_r[0]) == {f"layer_{i}" for i in range(3)}
    sparse = unboxed(grads_r[0]["layer_1"]["layer"])
    assert all(float(np.max(np.abs(np.asarray(sparse[name])))) > 0 for name in ("wi", "wo", "wo_bias"))


def test_float_context_gets_the_same_gradient_through_the_reverse_pass():
    class Gated(nn.Module):
        """``x -> Dense(x) * context``: a half-residual reading a differentiable context."""

        @nn.compact
        def __call__(self, x, gate, *, decisions=None, deterministic=True):
            return nn.Dense(D)(x) * gate, None

    x1, x2 = streams()
    gate = jnp.asarray(np.random.default_rng(3).uniform(size=(BATCH, LENGTH, D)), jnp.float32)
    halves = [Gated(), Gated()]
    variables = init(ReversibleStack(halves), x1, x2, gate)
    args = (variables, x1, x2, gate)
    _, grads_r = loss_and_grads(ReversibleStack(halves), *args, argnums=(0, 1, 2, 3))
    _, grads_p = loss_and_grads(ReversibleStack(halves, reversible=False), *args, argnums=(0, 1, 2, 3))
    assert_trees_close(grads_r, grads_p)


# Records, at trace time, whether each call of ParityGate was handed stored decisions.
GATE_CALLS = []


class ParityGate(nn.Module):
    """Chooses between two projections by the parity of ``floor(1e6 * x[..., 0])``: a discrete
    decision that flips when the input moves by ~1e-6, as a reconstructed input does."""

    replay: bool = True

    @nn.compact
    def __call__(self, x, *, decisions=None, deterministic=True):
        GATE_CALLS.append(decisions is not None)
        choice = parity(x)
        if decisions is not None and self.replay:
            choice = decisions
        y = jnp.where(choice[..., None] == 1, nn.Dense(D, name="a")(x), nn.Dense(D, name="b")(x))
        return y, choice


def parity(x, xp=jnp):
    """The decision: traced in the model (``jnp``), or on the host for a check (``np``, float32 as
    traced: no eager program to compile)."""
    return (xp.floor(x[..., 0] * 1e6) % 2).astype(xp.int32)


def host_parity(x):
    return parity(np.asarray(x, np.float32), np)


class LargeShift(nn.Module):
    """Adds ~1000 to the other stream: that stream is rebuilt as ``(x + 1000) - 1000``, off
    from ``x`` by float32 rounding (ulp(1000) = 6e-5)."""

    @nn.compact
    def __call__(self, x, *, decisions=None, deterministic=True):
        return 1000.0 + nn.Dense(D)(x), None


def test_reverse_pass_reuses_stored_decisions():
    x1, x2 = streams()
    stack = ReversibleStack([ParityGate(), LargeShift()])
    variables = init(stack, x1, x2)
    (y1, y2), state = fast_jit(lambda x1, x2: stack.apply(variables, x1, x2, mutable=["intermediates"]))(x1, x2)
    decisions = state["intermediates"]["decisions"][0]
    np.testing.assert_array_equal(decisions[0], host_parity(x2))
    assert decisions[1] is None

    # The gate's input is rebuilt with rounding error that flips its recomputed decision.
    inverse = fast_jit(
        lambda y1, y2, decisions: stack.apply(variables, y1, y2, decisions=decisions, method=ReversibleStack.inverse)
    )
    _, x2_rebuilt = inverse(y1, y2, decisions)
    np.testing.assert_allclose(x2_rebuilt, x2, atol=1e-4)
    assert np.any(host_parity(x2_rebuilt) != host_parity(x2))

    # Forward: the gate decides; reverse: it is handed the stored decisions.
    GATE_CALLS.clear()
    _, grads_r = loss_and_grads(stack, variables, x1, x2)
    assert GATE_CALLS == [False, True]
    _, grads_p = loss_and_grads(ReversibleStack([ParityGate(), LargeShift()], reversible=False), variables, x1, x2)
    assert_trees_close(grads_r, grads_p, atol=2e-4, rtol=1e-4)

    # Control: a gate that decides again in reverse gets visibly wrong gradients.
    recomputing = ReversibleStack([ParityGate(replay=False), LargeShift()])
    _, grads_bad = loss_and_grads(recomputing, variables, x1, x2)
    assert max_abs_diff(grads_bad, grads_p) > 1e-2


def test_inputs_are_reconstructed_from_outputs(three_layer_variables):
    halves = [attention_half(0.2), sparse_half(0.2, temperature=0.0), mlp_half(0.2)]
    x1, x2 = streams()
    mask = padding_mask()
    stack = ReversibleStack(halves)
    variables = three_layer_variables
    rngs = {"dropout": key(7)}
    forward = fast_jit(
        lambda x1, x2: stack.apply(variables, x1, x2, mask, deterministic=False, rngs=rngs, mutable=["intermediates"])
    )
    (y1, y2), state = forward(x1, x2)
    decisions = state["intermediates"]["decisions"][0]
    assert float(np.max(np.abs(np.asarray(y2) - np.asarray(x2)))) > 0.1  # the stack is far from the identity
    inverse = fast_jit(
        lambda y1, y2, decisions: stack.apply(
            variables, y1, y2, mask, decisions=decisions, deterministic=False, rngs=rngs, method=ReversibleStack.inverse
        )
    )
    x1_rebuilt, x2_rebuilt = inverse(y1, y2, decisions)
    np.testing.assert_allclose(x1_rebuilt, x1, atol=1e-5)
    np.testing.assert_allclose(x2_rebuilt, x2, atol=1e-5)


def test_activation_memory_does_not_grow_with_depth():
    x = jax.ShapeDtypeStruct((2, 512, 64), jnp.float32)

    def temp_bytes(depth, reversible):
        stack = ReversibleStack([HalfResidual(FeedForward(64, 256))] * depth, reversible=reversible)
        variables = jax.eval_shape(stack.init, jax.random.key(0), x, x)

        def loss(variables, x1, x2):
            y1, y2 = stack.apply(variables, x1, x2)
            return jnp.sum(y1 * y1) + jnp.sum(y2 * y2)

        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(variables, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain_growth = temp_bytes(8, False) - temp_bytes(2, False)
    reversible_growth = temp_bytes(8, True) - temp_bytes(2, True)
    hidden_bytes = 2 * 512 * 256 * 4  # one layer's [batch, length, d_ff] activation
    # Measured on XLA:CPU over the 6 extra layers: plain autodiff +18 MiB (~3 hiddens stored per
    # layer), reversible +2.5 MiB (~0.4 hidden per layer: a parameter broadcast XLA materialises,
    # not a stored activation).
    assert plain_growth > 2 * 6 * hidden_bytes
    assert reversible_growth < 6 * hidden_bytes
    assert reversible_growth * 4 < plain_growth


@pytest.mark.parametrize("ff_chunk_size", [0, 5])  # 5: 12 tokens in 3 chunks, each with its own draws
@pytest.mark.slow
def test_dropout_is_identical_in_both_passes(ff_chunk_size, three_layer_variables):
    sparse = sparse_half(0.3, temperature=0.1, quant_prob=0.5, ff_chunk_size=ff_chunk_size)
    halves = [attention_half(0.3), sparse, mlp_half(0.3)]
    x1, x2 = streams()
    mask = padding_mask()
    params = three_layer_variables["params"]
    reversible = loss_and_grads_fn(ReversibleStack(halves), deterministic=False)
    plain = loss_and_grads_fn(ReversibleStack(halves, reversible=False), deterministic=False)
    rngs = {"dropout": key(11)}
    loss_r, grads_r = reversible(params, x1, x2, mask, rngs=rngs)
    loss_p, grads_p = plain(params, x1, x2, mask, rngs=rngs)
    np.testing.assert_allclose(loss_r, loss_p, rtol=1e-6)
    assert_trees_close(grads_r, grads_p)
    # Dropout is really active: another key gives another loss.
    loss_other, _ = plain(params, x1, x2, mask, rngs={"dropout": key(12)})
    assert abs(float(loss_other - loss_p)) > 1e-3


def test_half_residuals_built_in_a_parent_module_live_in_the_stack_scope():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            # Modules constructed in a compact context (bound to Block) and a factory.
            stack = ReversibleStack([mlp_half(), sparse_half])
            y1, y2 = stack(x, x)
            return (y1 + y2) / 2

    x, _ = streams()
    variables = fast_jit(Block().init)(init_key(0), x)
    assert set(variables["params"]) == {"ReversibleStack_0"}
    assert set(variables["params"]["ReversibleStack_0"]) == {"layer_0", "layer_1"}
    assert "controller_up" in variables["params"]["ReversibleStack_0"]["layer_1"]["layer"]
    grads = fast_jit(jax.grad(lambda v: jnp.sum(Block().apply(v, x) ** 2)))(variables)
    assert all(
        float(np.max(np.abs(np.asarray(g)))) > 0
        for g in jax.tree.leaves(grads["params"]["ReversibleStack_0"]["layer_0"])
    )


def test_decoding_with_a_cache_matches_the_full_sequence_forward():
    attention = HalfResidual(
        CausalSelfAttention(D, n_heads=2), pass_kwargs=("deterministic", "decode", "max_decode_length")
    )
    stack = ReversibleStack([attention, sparse_half()])
    x1, x2 = streams()
    variables = init(stack, x1, x2)
    full = fast_jit(stack.apply)(variables, x1, x2)  # the pure (custom-VJP) path

    # The cache-creating call, then one token per call: the layers run as bound submodules.
    _, state = fast_jit(
        lambda x1, x2: stack.apply(variables, x1, x2, decode=True, max_decode_length=LENGTH, mutable=["cache"])
    )(x1[:, :1], x2[:, :1])
    step = fast_jit(lambda state, x1, x2: stack.apply({**variables, **state}, x1, x2, decode=True, mutable=["cache"]))
    steps = []
    for t in range(LENGTH):
        ys, state = step(state, x1[:, t : t + 1], x2[:, t : t + 1])
        steps.append(ys)
    for i in range(2):
        np.testing.assert_allclose(jnp.concatenate([s[i] for s in steps], axis=1), full[i], atol=1e-5)
