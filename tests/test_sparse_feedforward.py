"""SparseFeedForward (paper §3.1, docs/design/reference_code.md §1 and the §9 checklist) and the
mixture-of-experts baseline."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.errors import ConfigError
from terra.layers import MixtureOfExpertsFeedForward, SparseFeedForward
from terra.layers.selection import block_argmax
from terra.layers.sparse_feedforward import chunk_layout, to_chunks

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D_MODEL, D_FF, N = 16, 64, 8  # 8 blocks of 8 units


def _layer(**kwargs):
    return SparseFeedForward(d_model=D_MODEL, d_ff=D_FF, ff_sparsity=N, **kwargs)


@pytest.fixture(scope="module")
def layer_and_vars():
    layer = _layer()
    x = jax.random.normal(jax.random.key(0), (3, 5, D_MODEL))
    # Jitted: one program, where op by op each initializer's operations compile on their own.
    return layer, jax.jit(layer.init)(jax.random.key(1), x), x


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, including those inside nested calls (pjit, custom_jvp...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("deterministic", "decode"))
def _run(layer, variables, x, indices=None, rngs=None, *, deterministic=True, decode=False):
    """``layer.apply``'s output and the indices it chose, compiled once per layer and signature
    and shared by the tests (op by op, each operation compiles on its own)."""
    y, state = layer.apply(
        variables, x, deterministic=deterministic, decode=decode, indices=indices, rngs=rngs, mutable=["intermediates"]
    )
    return y, state["intermediates"]["indices"][0]


def _apply(layer, variables, x, **kwargs):
    return _run(layer, variables, x, **kwargs)[0]


def _indices(layer, variables, x, **kwargs):
    return _run(layer, variables, x, **kwargs)[1]


def test_controller_is_low_rank_with_d_lowrank_d_ff_over_n(layer_and_vars):
    _, variables, _ = layer_and_vars
    params = nn.unbox(variables)["params"]
    assert params["controller_down"]["kernel"].shape == (D_FF // N, D_MODEL)  # C1, output-major
    assert params["controller_up"].shape == (D_FF // N, D_FF // N, N)  # C2 [d_lowrank, blocks, N]
    assert params["controller_bias"].shape == (D_FF // N, N)
    assert params["wi"].shape == params["wo"].shape == (D_FF // N, N, D_MODEL)
    assert params["wo_bias"].shape == (D_MODEL,) and "wi_bias" not in params  # no first-layer bias
    explicit = jax.eval_shape(_layer(d_lowrank=5).init, jax.random.key(0), jnp.ones((1, 1, D_MODEL)))
    assert nn.unbox(explicit)["params"]["controller_down"]["kernel"].shape == (5, D_MODEL)


def test_decode_gather_equals_eval_mask(layer_and_vars):
    layer, variables, x = layer_and_vars
    np.testing.assert_allclose(
        _apply(layer, variables, x, decode=True), _apply(layer, variables, x), atol=1e-5, rtol=1e-5
    )


def test_decode_reads_only_the_selected_row_of_each_block(layer_and_vars):
    layer, variables, x = layer_and_vars
    x = x[:1, :1]  # one token
    idx = _indices(layer, variables, x)[0, 0]
    params = nn.unbox(variables)["params"]
    keep = jax.nn.one_hot(idx, N)[..., None]  # [blocks, N, 1]
    zeroed = {**params, "wi": params["wi"] * keep, "wo": params["wo"] * keep}
    np.testing.assert_allclose(
        _apply(layer, {"params": zeroed}, x, decode=True), _apply(layer, variables, x, decode=True), atol=1e-6
    )
    # No product in the decode path touches a full [d_ff, d_model] matrix: only gathered rows.
    jaxpr = jax.make_jaxpr(lambda v, x: layer.apply(v, x, decode=True))(variables, x)
    eqns = list(_all_eqns(jaxpr.jaxpr))
    gathers = [e for e in eqns if e.primitive.name == "gather"]
    assert sorted(tuple(e.outvars[0].aval.shape) for e in gathers) == [(1, 1, D_FF // N, D_MODEL)] * 2
    assert any(e.primitive.name == "dot_general" for e in eqns)
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            assert all(v.aval.size < D_FF * D_MODEL for v in eqn.invars), eqn


def test_eval_picks_the_argmax_with_no_noise(layer_and_vars):
    layer, variables, x = layer_and_vars
    logits = jax.jit(lambda v, x: layer.apply(v, x, method=layer.controller_logits))(variables, x)
    np.testing.assert_array_equal(_indices(layer, variables, x), jnp.argmax(logits, -1))
    ties = jnp.array([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    np.testing.assert_array_equal(jax.jit(block_argmax)(ties), np.argmax(ties, -1))
    out = _apply(layer, variables, x, rngs={"dropout": jax.random.key(5)})
    np.testing.assert_array_equal(out, _apply(layer, variables, x, rngs={"dropout": jax.random.key(6)}))


def test_training_with_temperature_zero_picks_the_eval_indices(layer_and_vars):
    _, variables, x = layer_and_vars
    layer = _layer(temperature=0.0)
    train = _indices(layer, variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(train, _indices(layer, variables, x))
    noisy = _layer(temperature=100.0)
    assert not np.array_equal(
        _indices(noisy, variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)}), train
    )


def test_the_hard_mask_is_used_on_about_quant_prob_of_calls(layer_and_vars):
    _, variables, x = layer_and_vars
    layer = _layer(temperature=0.0, quant_prob=0.3)
    eval_out = _apply(layer, variables, x)

    @jax.jit
    def is_hard(key):
        out = layer.apply(variables, x, deterministic=False, rngs={"dropout": key})
        return jnp.max(jnp.abs(out - eval_out)) < 1e-5  # the hard branch reproduces eval

    hard = jax.vmap(is_hard)(jax.random.split(jax.random.key(0), 2000))
    assert abs(float(hard.mean()) - 0.3) < 0.04


def test_straight_through_trains_the_controller_and_not_unselected_units(layer_and_vars):
    _, variables, x = layer_and_vars
    layer = _layer(temperature=0.0, quant_prob=1.0)  # always the hard branch
    x = x[:1, :1]
    params = nn.unbox(variables)["params"]
    idx = _indices(layer, variables, x)[0, 0]

    def loss(p):
        return jnp.sum(layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(0)}) ** 2)

    grads = jax.jit(jax.grad(loss))(params)  # one program, where op by op each operation compiles alone
    assert np.any(grads["controller_up"] != 0) and np.any(grads["controller_down"]["kernel"] != 0)
    unselected = 1.0 - jax.nn.one_hot(idx, N)[..., None]
    assert np.all(grads["wi"] * unselected == 0) and np.all(grads["wo"] * unselected == 0)
    np.testing.assert_allclose(
        _apply(layer, {"params": params}, x, deterministic=False, rngs={"dropout": jax.random.key(0)}),
        _apply(layer, variables, x),
        atol=1e-6,
    )


def test_given_indices_replace_the_controllers_choice(layer_and_vars):
    layer, variables, x = layer_and_vars
    forced = jnp.zeros((3, 5, D_FF // N), jnp.int32)
    assert np.array_equal(_indices(layer, variables, x, indices=forced), forced)
    np.testing.assert_allclose(
        _apply(layer, variables, x, indices=forced, decode=True), _apply(layer, variables, x, indices=forced), atol=1e-5
    )


def test_paper_formula_option_adds_the_first_layer_bias_and_decodes_the_same():
    layer = _layer(paper_formula=True)
    x = jax.random.normal(jax.random.key(0), (2, 3, D_MODEL))
    variables = jax.jit(layer.init)(jax.random.key(1), x)
    assert nn.unbox(variables)["params"]["wi_bias"].shape == (D_FF // N, N)
    np.testing.assert_allclose(_apply(layer, variables, x, decode=True), _apply(layer, variables, x), atol=1e-5)


def test_d_ff_not_divisible_by_n_is_a_config_error():
    with pytest.raises(ConfigError, match="d_ff=64 is not divisible by ff_sparsity=12"):
        SparseFeedForward(d_model=D_MODEL, d_ff=D_FF, ff_sparsity=12).init(jax.random.key(0), jnp.ones((1, 1, D_MODEL)))


def test_ff_chunk_size_draws_one_coin_per_chunk(layer_and_vars):
    _, variables, x = layer_and_vars  # 3 x 5 = 15 tokens
    n_tokens = 15
    n_chunks, chunk_len = chunk_layout(n_tokens, 4)
    assert (n_chunks, chunk_len) == (4, 4)  # equal chunks of at most 4, one padding token
    eval_out = _apply(_layer(), variables, x)

    def hard_tokens(ff_chunk_size):
        """Per key, which tokens took the hard branch: with temperature 0 and no dropout the
        hard straight-through mask reproduces the eval output, the soft one does not."""
        layer = _layer(temperature=0.0, quant_prob=0.5, ff_chunk_size=ff_chunk_size)

        @jax.jit
        def hard(key):
            out = layer.apply(variables, x, deterministic=False, rngs={"dropout": key})
            return jnp.max(jnp.abs(out - eval_out), axis=-1).reshape(-1) < 1e-5

        return np.asarray(jax.vmap(hard)(jax.random.split(jax.random.key(0), 400)))

    chunked = hard_tokens(4)
    # Every chunk is all hard or all soft (the padding token of the last chunk dropped) ...
    by_chunk = np.stack([np.asarray(to_chunks(jnp.asarray(row), n_chunks, chunk_len)) for row in chunked])
    real = np.asarray(to_chunks(jnp.ones(n_tokens, bool), n_chunks, chunk_len))
    for j in range(n_chunks):
        values = by_chunk[:, j][:, real[j]]
        assert np.all(values == values[:, :1])
    # ... each chunk with its own coin: with 4 independent fair coins, 7/8 of the calls mix
    # hard and soft chunks; each chunk is hard on about half of the calls.
    mixed = np.mean(chunked.any(axis=1) & ~chunked.all(axis=1))
    assert 0.75 < mixed < 0.97, mixed
    np.testing.assert_allclose(by_chunk[:, :, 0].mean(axis=0), 0.5, atol=0.1)
    # Without chunks, one coin for the whole call.
    whole = hard_tokens(0)
    assert np.all(whole == whole[:, :1]) and 0.4 < whole[:, 0].mean() < 0.6


@pytest.mark.parametrize("ff_chunk_size", [1, 4, 6, 15, 100])
@pytest.mark.slow
def test_ff_chunk_size_leaves_eval_output_unchanged(layer_and_vars, ff_chunk_size):
    layer, variables, x = layer_and_vars
    chunked = _layer(ff_chunk_size=ff_chunk_size)
    assert jax.tree.structure(jax.eval_shape(chunked.init, jax.random.key(1), x)) == jax.tree.structure(variables)
    np.testing.assert_allclose(_apply(chunked, variables, x), _apply(layer, variables, x), atol=1e-6)
    np.testing.assert_array_equal(_indices(chunked, variables, x), _indices(layer, variables, x))
    np.testing.assert_allclose(_apply(chunked, variables, x, decode=True), _apply(layer, variables, x), atol=1e-5)
    # Given indices (a reversible layer's replay) are used chunk by chunk too.
    forced = jnp.zeros((3, 5, D_FF // N), jnp.int32)
    np.testing.assert_allclose(
        _apply(chunked, variables, x, indices=forced), _apply(layer, variables, x, indices=forced), atol=1e-6
    )
    np.testing.assert_array_equal(_indices(chunked, variables, x, indices=forced), forced)


@pytest.mark.slow
def test_ff_chunk_size_bounds_the_training_memory():
    d_model, d_ff = 16, 512

    def temp_bytes(n_tokens, ff_chunk_size):
        """XLA's scratch memory for the gradient of a training call on ``n_tokens`` tokens."""
        x = jax.ShapeDtypeStruct((2, n_tokens // 2, d_model), jnp.float32)
        layer = SparseFeedForward(d_model=d_model, d_ff=d_ff, ff_sparsity=8, ff_chunk_size=ff_chunk_size)
        variables = jax.eval_shape(layer.init, jax.random.key(0), x)

        def loss(params, x, key):
            return jnp.sum(layer.apply({"params": params}, x, deterministic=False, rngs={"dropout": key}) ** 2)

        key = jax.eval_shape(lambda: jax.random.key(0))
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(variables["params"], x, key).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    extra_hidden = (2048 - 512) * d_ff * 4  # the [tokens, d_ff] activation of the extra tokens
    whole_growth = temp_bytes(2048, 0) - temp_bytes(512, 0)
    chunked_small, chunked_large = temp_bytes(512, 64), temp_bytes(2048, 64)
    # Measured on XLA:CPU: the whole call keeps ~15 [tokens, d_ff] buffers for its backward pass
    # (+33 MB for 1536 more tokens); the rematerialised scan holds one 64-token chunk's worth
    # whatever the token count (+0.2 MB: the [tokens, d_model] inputs, outputs and gradients).
    assert whole_growth > 4 * extra_hidden
    assert chunked_large - chunked_small < extra_hidden / 4
    assert chunked_large * 4 < temp_bytes(512, 0)


def test_inference_chunks_leave_eval_output_unchanged_and_bound_its_memory(layer_and_vars):
    """A deterministic call over more tokens than inference_chunk_size (a long prefill) runs in
    chunks: the same outputs and choices, and one chunk's [tokens, d_ff] buffers at a time."""
    layer, variables, x = layer_and_vars
    chunked = _layer(inference_chunk_size=4)
    np.testing.assert_allclose(_apply(chunked, variables, x), _apply(layer, variables, x), atol=1e-6)
    np.testing.assert_array_equal(_indices(chunked, variables, x), _indices(layer, variables, x))

    def temp_bytes(inference_chunk_size):
        x = jax.ShapeDtypeStruct((1, 2048, 16), jnp.float32)
        layer = SparseFeedForward(d_model=16, d_ff=512, ff_sparsity=8, inference_chunk_size=inference_chunk_size)
        params = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
        compiled = jax.jit(lambda p, x: layer.apply({"params": p}, x)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # One [2048, 512] float32 activation is 4 MB; chunks of 64 tokens hold a thirty-second of it.
    assert temp_bytes(64) * 4 < temp_bytes(0)


def test_a_stack_of_chunked_inference_calls_holds_one_layers_output_at_a_time():
    """Layers of chunked deterministic calls one after another (a long prefill's stack): the
    temporaries do not grow with the layers. A scan's stacked output would start as zeros that
    XLA shares between the layers and copies for each early in the program, one [tokens,
    d_model] buffer per layer held at once (issue 40: 1.5 GB at 15,360 tokens and 24 layers)."""
    tokens, d_model = 4096, 64
    layer = SparseFeedForward(d_model=d_model, d_ff=256, ff_sparsity=8, inference_chunk_size=256)
    x = jax.ShapeDtypeStruct((1, tokens, d_model), jnp.float32)
    params = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]

    def temp_bytes(n_layers):
        def stack(params, x):
            for p in params:
                x = x + layer.apply({"params": p}, x)
            return x

        compiled = jax.jit(stack).lower([params] * n_layers, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_output = tokens * d_model * 4
    assert temp_bytes(8) - temp_bytes(2) < one_output


@pytest.mark.parametrize("name", ["ff_chunk_size", "inference_chunk_size"])
def test_bad_chunk_size_is_a_config_error(name):
    with pytest.raises(ConfigError, match=f"{name}=-1"):
        _layer(**{name: -1}).init(jax.random.key(0), jnp.ones((1, 1, D_MODEL)))


def test_moe_baseline_decode_equals_eval_and_reads_one_block():
    layer = MixtureOfExpertsFeedForward(d_model=D_MODEL, d_ff=D_FF, n_experts=4)
    x = jax.random.normal(jax.random.key(0), (2, 5, D_MODEL))
    variables = jax.jit(layer.init)(jax.random.key(1), x)
    both = jax.jit(lambda v, x: (layer.apply(v, x, decode=True), layer.apply(v, x)))  # one program
    np.testing.assert_allclose(*both(variables, x), atol=1e-5)
    params = nn.unbox(variables)["params"]
    assert (
        MixtureOfExpertsFeedForward.params_read_per_token(params) == 4 * D_MODEL + 2 * (D_FF // 4) * D_MODEL + D_MODEL
    )
    with pytest.raises(ConfigError, match="n_experts"):
        MixtureOfExpertsFeedForward(d_model=D_MODEL, d_ff=D_FF, n_experts=5).init(jax.random.key(0), x)
