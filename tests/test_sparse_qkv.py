"""The multiplicative layer, sparse QKV attention, the sparse query cross-attention and the
sparse loss (paper §3.2–3.3, docs/design/reference_code.md §2–§3 and the §9 checklist)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import native_kernels
from terra.errors import ConfigError
from terra.layers import MultiplicativeDense, SparseLossLogits, SparseQKVAttention, SparseQueryCrossAttention
from terra.layers.multiplicative import COMBINED_KERNEL_ROWS
from terra.layers.sparse_qkv import convolve_modules, sparse_qkv_param_count

from cheap_init_prng import init_key
from helpers import quantize_params_for_setup

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D, H = 32, 4  # S = H = 4 modules of M = 8


def _size(tree):
    return sum(x.size for x in jax.tree.leaves(nn.unbox(tree)))


@functools.cache
def _sparse_qkv(variant):
    """The layer and its variables (any parameters prove what its tests check: decode equals the
    full pass, causality), initialised in one program from a key that compiles cheaply and
    shared by the tests of the variant."""
    layer = SparseQKVAttention(d_model=D, n_heads=H, variant=variant)
    return layer, jax.jit(layer.init)(init_key(1), jnp.ones((1, 3, D)))


def test_multiplicative_dense_computes_the_gated_product():
    layer = MultiplicativeDense(12, n_modules=3)
    x = jax.random.normal(jax.random.key(0), (2, 5, 7))

    @jax.jit  # one program, where op by op each operation compiles on its own
    def run(x):
        variables = layer.init(jax.random.key(1), x)
        p = nn.unbox(variables)["params"]
        expected = jnp.einsum("bli,si,im->blsm", x, p["gate"], p["kernel"]).reshape(2, 5, 12) + p["bias"]
        return p, layer.apply(variables, x), expected

    p, y, expected = run(x)
    assert p["gate"].shape == (3, 7) and p["kernel"].shape == (7, 4) and p["bias"].shape == (12,)
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)
    assert abs(float(np.std(np.asarray(p["gate"]))) - 0.5) < 0.2  # D ~ N(0, 0.5^2) as the reference


@pytest.mark.parametrize("kind", [None, "int8"])
def test_multiplicative_dense_folds_the_gate_into_the_kernel_for_many_rows(kind):
    """From COMBINED_KERNEL_ROWS rows (a prefill, training) the product runs on E scaled by each
    module's gate, one [d_in, S·M] kernel: the same outputs as the gated product of few rows, for
    float and narrow stored weights."""
    layer = MultiplicativeDense(12, n_modules=3)
    x = jax.random.normal(jax.random.key(2), (2, COMBINED_KERNEL_ROWS, 7))
    params = nn.unbox(jax.jit(layer.init)(init_key(3), x))["params"]
    if kind:
        params = quantize_params_for_setup(params, kind)

    @jax.jit  # one program, where op by op each operation compiles on its own
    def many_and_few(params, x):
        many = layer.apply({"params": params}, x)
        few = [layer.apply({"params": params}, x[:, i : i + 8]) for i in range(0, x.shape[1], 8)]
        return many, jnp.concatenate(few, 1)

    many, few = many_and_few(params, x)
    np.testing.assert_allclose(many, few, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_multiplicative_layer_represents_any_permutation(seed):
    s_modules, m = 4, 6
    d = s_modules * m
    perm = np.random.default_rng(seed).permutation(d)  # input i goes to output slot perm[i] = (s, m)
    gate = np.zeros((s_modules, d), np.float32)
    kernel = np.zeros((d, m), np.float32)
    for i, slot in enumerate(perm):
        gate[slot // m, i] = 1.0
        kernel[i, slot % m] = 1.0
    params = {"gate": gate, "kernel": kernel, "bias": np.zeros(d, np.float32)}
    x = jax.random.normal(jax.random.key(seed), (3, d))
    y = _permuting_apply(params, x)
    np.testing.assert_allclose(np.asarray(y)[:, perm], x, atol=1e-6)


@jax.jit  # one program for every seed
def _permuting_apply(params, x):
    return MultiplicativeDense(x.shape[-1], n_modules=4).apply({"params": params}, x)


def test_multiplicative_output_not_divisible_by_s_is_a_config_error():
    with pytest.raises(ConfigError, match="not divisible by S=5"):
        MultiplicativeDense(12, n_modules=5).init(jax.random.key(0), jnp.ones((1, 4)))


@pytest.mark.parametrize("variant", ["multconv", "mult", "conv"])
@pytest.mark.slow
def test_sparse_qkv_token_by_token_decode_matches_the_full_pass(variant):
    layer, variables = _sparse_qkv(variant)
    x = jax.random.normal(jax.random.key(0), (2, 7, D))

    @jax.jit  # one program, where op by op each operation compiles on its own
    def set_up(x):
        _, cache = layer.apply(variables, x[:, :1], decode=True, max_decode_length=9, mutable=["cache"])
        return layer.apply(variables, x), cache

    full, cache = set_up(x)
    # One compiled step for every position (op by op, each step dispatches its operations alone).
    step = jax.jit(lambda c, x: layer.apply({**variables, **c}, x, decode=True, mutable=["cache"]))
    for t in range(x.shape[1]):
        out, cache = step(cache, x[:, t : t + 1])
        np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["multconv", "mult", "conv"])
def test_sparse_qkv_is_causal(variant):
    layer, variables = _sparse_qkv(variant)
    x = jax.random.normal(jax.random.key(0), (1, 8, D))

    @jax.jit  # one program, where op by op each operation compiles on its own
    def outputs(x):
        return layer.apply(variables, x), layer.apply(variables, x.at[:, 4].add(1.0))

    a, b = outputs(x)
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not np.allclose(a[:, 4:], b[:, 4:], atol=1e-4)


def test_sparse_qkv_shares_one_multiplicative_layer_and_has_no_output_projection():
    layer = SparseQKVAttention(d_model=D, n_heads=H)
    variables = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((1, 3, D)))  # shapes are checked
    p = nn.unbox(variables)["params"]
    assert set(p) == {"mult", "q_conv", "k_conv", "v_conv"}
    m = D // H
    assert p["q_conv"]["kernel"].shape == p["k_conv"]["kernel"].shape == (3, 3, m, m)  # F x k over (length, modules)
    assert p["v_conv"]["kernel"].shape == (3, 1, m, m)
    assert _size(variables) == sparse_qkv_param_count(D, H, H)
    # The 800M layer: S = 16, M = 64 -> the paper's ~0.17M against 4.2M for dense QKVO.
    assert sparse_qkv_param_count(1024, 16, 16) == 16 * 1024 + 1024 * 64 + 1024 + 2 * (9 * 64**2 + 64) + 3 * 64**2 + 64


def test_sparse_qkv_d_model_not_divisible_by_s_is_a_config_error():
    with pytest.raises(ConfigError, match="not divisible by attention_sparsity S=5"):
        SparseQKVAttention(d_model=D, n_heads=H, attention_sparsity=5).init(jax.random.key(0), jnp.ones((1, 2, D)))
    with pytest.raises(ConfigError, match="variant"):
        SparseQKVAttention(d_model=D, n_heads=H, variant="dense").init(jax.random.key(0), jnp.ones((1, 2, D)))


@pytest.mark.slow
def test_sparse_query_cross_attention_decode_matches_the_full_pass():
    layer = SparseQueryCrossAttention(d_model=D, n_heads=H)
    x = jax.random.normal(jax.random.key(0), (2, 6, D))
    encoded = jax.random.normal(jax.random.key(1), (2, 5, D))
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    garbage = encoded.at[1, 3:].set(100.0)

    @jax.jit  # one program, where op by op each operation compiles on its own
    def set_up(x, encoded, mask, garbage):
        variables = layer.init(init_key(2), x, encoded, mask)
        _, cache = layer.apply(variables, x[:, :1], encoded, mask, decode=True, mutable=["cache"])
        return variables, layer.apply(variables, x, encoded, mask), cache, layer.apply(variables, x, garbage, mask)

    variables, full, cache, with_garbage = set_up(x, encoded, mask, garbage)
    step = jax.jit(lambda c, x: layer.apply({**variables, **c}, x, None, None, decode=True, mutable=["cache"]))
    for t in range(x.shape[1]):
        out, cache = step(cache, x[:, t : t + 1])
        np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert "out" not in nn.unbox(variables)["params"]  # no output projection
    # Padded encoder positions are ignored.
    np.testing.assert_allclose(with_garbage, full, atol=1e-5)


def test_sparse_loss_is_a_multiplicative_layer_over_the_vocabulary():
    layer = SparseLossLogits(vocab_size=40, loss_sparsity=4)
    x = jax.random.normal(jax.random.key(0), (2, 3, D))
    s, m = 2, 7

    @jax.jit  # one program, where op by op each operation compiles on its own
    def run(x):
        variables = layer.init(init_key(1), x)
        p = nn.unbox(variables)["params"]["multiplicative"]
        # Vocabulary id s*(V/S) + m is module s, element m.
        expected = jnp.einsum("bli,i,i->bl", x, p["gate"][s], p["kernel"][:, m]) + p["bias"][s * 10 + m]
        return variables, layer.apply(variables, x), expected

    variables, logits, expected = run(x)
    assert _size(variables) == 4 * D + D * 40 // 4 + 40  # S*d + d*V/S + V
    assert logits.shape == (2, 3, 40) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits[..., s * 10 + m], expected, atol=1e-5)
    with pytest.raises(ConfigError, match="vocab_size=40 is not divisible by loss_sparsity=3"):
        SparseLossLogits(vocab_size=40, loss_sparsity=3).init(jax.random.key(0), x)


native = pytest.mark.skipif(not native_kernels.available(), reason="terra's native kernels are not built")


@jax.jit  # one program per signature, where op by op each operation compiles on its own
def _xla_convolution(u, kernel, bias):
    f, k = kernel.shape[:2]
    padded = jnp.pad(u, ((0, 0), (f - 1, 0), ((k - 1) // 2, (k - 1) // 2), (0, 0)))
    dims = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(padded, kernel, (1, 1), "VALID", dimension_numbers=dims) + bias


@native
@pytest.mark.parametrize("length,modules,f,k,m,n", [(150, 4, 3, 3, 8, 16), (5, 3, 3, 1, 5, 32), (70, 16, 2, 5, 64, 64)])
def test_native_module_convolution_equals_the_convolution_op(length, modules, f, k, m, n):
    """Blocks of positions and a last partial one, sequences shorter than the window, module
    kernels wider than one and than the modules' padding, against XLA's convolution op, in every
    instruction set; the gradient is the XLA form's."""
    rng = np.random.default_rng(length + k)
    u = jnp.asarray(rng.normal(size=(2, length, modules, m)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(f, k, m, n)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
    convolve = jax.jit(lambda u, w, b: convolve_modules(u, w, b))
    assert native_kernels.TARGETS["module_convolution", "float32"] in convolve.lower(u, kernel, bias).as_text()
    want = _xla_convolution(u, kernel, bias)
    # Two float32 sums of the same f·k·m products in other orders differ by rounding that grows
    # with the terms' magnitudes, not the (cancelling) result's: allow a few ulps of the sum of
    # |terms| times sqrt(terms) at each output; a wrong position, module or weight is off by O(1).
    terms = _xla_convolution(jnp.abs(u), jnp.abs(kernel), jnp.abs(bias))
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(f * k * m) * np.asarray(terms)
    try:
        for isa in native_kernels.ISAS:
            native_kernels.use_isa(isa)
            error = np.abs(np.asarray(convolve(u, kernel, bias)) - np.asarray(want))
            assert np.all(error <= bound), (isa, float(np.max(error / bound)))
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])
    weights = jnp.asarray(rng.normal(size=want.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(convolve_modules(*a) * weights), (0, 1, 2)))(u, kernel, bias)
    want_grads = jax.jit(jax.grad(lambda *a: jnp.sum(_xla_convolution(*a) * weights), (0, 1, 2)))(u, kernel, bias)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@native
def test_native_module_convolution_refuses_operands_that_disagree():
    u, bias = jnp.zeros((1, 8, 4, 8)), jnp.zeros((16,))
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(native_kernels.module_convolution(u, jnp.zeros((3, 3, 7, 16)), bias))
    with pytest.raises(Exception, match="odd module kernel"):
        jax.block_until_ready(native_kernels.module_convolution(u, jnp.zeros((3, 2, 8, 16)), bias))
