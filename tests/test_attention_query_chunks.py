"""Long-input prefill: attention computed a chunk of queries at a time equals the whole
computation, and so does the native blocked attention a deterministic long forward runs on the CPU
(issue 40: a 15,360-token prefill never holds [heads, L, L] scores whole)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import blocked_attention, native_kernels
from terra.layers.attention import (
    CausalSelfAttention,
    CrossAttention,
    SelfAttention,
    attention_in_query_chunks,
    causal_bias,
    padding_bias,
)

pytestmark = pytest.mark.usefixtures("fast_compile")


def _whole(q, k, v, bias):
    logits = jnp.einsum("bhqd,bhkd->bhqk", q * q.shape[-1] ** -0.5, k) + bias
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [5, 8, 37, 64])
def test_attention_in_query_chunks_equals_whole_attention(causal, chunk):
    rng = np.random.default_rng(chunk)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 37, 8)), jnp.float32) for _ in range(3))
    mask = jnp.asarray(rng.random((2, 37)) > 0.2).at[:, 0].set(True)
    bias = padding_bias(mask)
    whole = _whole(q, k, v, bias + (causal_bias(37) if causal else 0.0))
    chunked = attention_in_query_chunks(q, k, v, bias, causal=causal, chunk=chunk)
    np.testing.assert_allclose(chunked, whole, atol=2e-6, rtol=0)


def _outputs(module_class, chunk, *args, **kwargs):
    module = module_class(d_model=16, n_heads=2, query_chunk_size=chunk)
    variables = module.init(jax.random.key(0), *args, **kwargs)
    return module.apply(variables, *args, **kwargs)


def test_encoder_and_cross_attention_chunk_long_queries_without_changing_outputs():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 23, 16)), jnp.float32)
    encoded = jnp.asarray(rng.normal(size=(2, 19, 16)), jnp.float32)
    mask = jnp.ones((2, 23), bool).at[1, 17:].set(False)
    encoder_mask = jnp.ones((2, 19), bool).at[0, 11:].set(False)
    np.testing.assert_allclose(_outputs(SelfAttention, 4, x, mask), _outputs(SelfAttention, 512, x, mask), atol=2e-6)
    np.testing.assert_allclose(
        _outputs(CrossAttention, 4, x, encoded, encoder_mask),
        _outputs(CrossAttention, 512, x, encoded, encoder_mask),
        atol=2e-6,
    )


def test_causal_prefill_in_query_chunks_fills_the_same_cache_and_outputs():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(1, 21, 16)), jnp.float32)
    prefix_mask = jnp.ones((1, 21), bool).at[0, 18:].set(False)
    results = []
    for chunk in (4, 512):
        module = CausalSelfAttention(d_model=16, n_heads=2, query_chunk_size=chunk)
        params = module.init(jax.random.key(0), x)["params"]
        y, variables = module.apply(
            {"params": params}, x, decode=True, max_decode_length=32, prefix_mask=prefix_mask, mutable=["cache"]
        )
        results.append((y, variables["cache"]))
    (y_chunked, cache_chunked), (y_whole, cache_whole) = results
    np.testing.assert_allclose(y_chunked, y_whole, atol=2e-6)
    for a, b in zip(jax.tree.leaves(cache_chunked), jax.tree.leaves(cache_whole)):
        np.testing.assert_array_equal(a, b)
    # Training (no prefix) takes the same chunked path.
    np.testing.assert_allclose(_outputs(CausalSelfAttention, 4, x), _outputs(CausalSelfAttention, 512, x), atol=2e-6)


native = pytest.mark.skipif(not native_kernels.available(), reason="terra's native kernels are not built")


def _operands(seed, batch, heads, lq, lk, d, masked=0.2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, heads, lq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(batch, heads, lk, d)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((batch, lk)) > masked).at[:, 0].set(True)
    return q, k, v, padding_bias(mask)


@native
@pytest.mark.parametrize(
    "causal,lq,lk,d",
    # Tails of a query block (64) and of a key tile (256), a head size of one vector and of several.
    [(False, 300, 300, 64), (True, 300, 300, 64), (False, 70, 513, 16), (True, 129, 129, 48)],
)
def test_native_blocked_attention_equals_whole_attention(causal, lq, lk, d):
    """The native prefill attention (blocks of queries against tiles of keys, online softmax) against
    the whole softmax, with padded keys, in every instruction set; the lowered program calls it."""
    q, k, v, bias = _operands(lq + d, 2, 3, lq, lk, d)
    whole = _whole(q, k, v, bias + (causal_bias(lq) if causal else 0.0))
    attend = jax.jit(lambda *a: blocked_attention(*a, causal=causal, chunk=64))
    assert native_kernels.TARGETS["blocked_attention", causal] in attend.lower(q, k, v, bias).as_text()
    try:
        for isa in native_kernels.ISAS:  # read at run time: every variant this CPU can run
            native_kernels.use_isa(isa)
            np.testing.assert_allclose(attend(q, k, v, bias), whole, atol=2e-6, rtol=0, err_msg=native_kernels.isa())
    finally:
        native_kernels.use_isa(native_kernels.ISAS[-1])


@native
def test_blocked_attention_gradient_is_the_chunked_forms():
    """Differentiating the native forward differentiates the XLA form: the same gradients."""
    q, k, v, bias = _operands(3, 1, 2, 80, 80, 16)
    weights = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    native_grads = jax.grad(loss(lambda *a: blocked_attention(*a, bias, causal=True, chunk=32)), argnums=(0, 1, 2))
    xla_grads = jax.grad(loss(lambda *a: attention_in_query_chunks(*a, bias, causal=True, chunk=32)), argnums=(0, 1, 2))
    for fast, slow in zip(native_grads(q, k, v), xla_grads(q, k, v)):
        np.testing.assert_allclose(fast, slow, atol=1e-5, rtol=1e-5)


@native
def test_deterministic_long_attention_runs_the_native_kernel_with_the_same_outputs():
    """A layer whose queries outnumber query_chunk_size attends them in one native call when
    deterministic (prefill, evaluation), the chunked XLA form when not: the same outputs."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 40, 32)), jnp.float32)
    mask = jnp.ones((2, 40), bool).at[1, 30:].set(False)
    module = SelfAttention(d_model=32, n_heads=2, query_chunk_size=8)
    variables = module.init(jax.random.key(0), x, mask)
    apply = jax.jit(lambda d: module.apply(variables, x, mask, deterministic=d), static_argnums=0)
    assert "terra_blocked_attention" in apply.lower(True).as_text()
    assert "terra_blocked_attention" not in apply.lower(False).as_text()
    np.testing.assert_allclose(apply(True), apply(False), atol=2e-6)
    whole = SelfAttention(d_model=32, n_heads=2, query_chunk_size=512).apply(variables, x, mask, deterministic=True)
    np.testing.assert_allclose(apply(True), whole, atol=2e-6)


@native
def test_native_blocked_attention_refuses_operands_that_disagree():
    """Shapes are checked before anything is read: one error naming the header that lists them."""
    q, k, v, bias = _operands(6, 1, 2, 16, 16, 16)
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(native_kernels.blocked_attention(q, k, v, bias[:, 0, 0, :8], causal=False))
    with pytest.raises(Exception, match="as many queries as keys"):
        jax.block_until_ready(native_kernels.blocked_attention(q[:, :, :8], k, v, bias[:, 0, 0], causal=True))
