"""Long-input prefill: attention computed a chunk of queries at a time equals the whole
computation, and so does the native blocked attention a deterministic long forward runs on the CPU
(issue 40: a 15,360-token prefill never holds [heads, L, L] scores whole)."""

import functools

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


@functools.partial(jax.jit, static_argnames="causal")
def _whole(q, k, v, bias, causal=False):
    """Softmax attention over every key at once (one compiled program per signature: op by op,
    each operation compiles on its own)."""
    if causal:
        bias = bias + causal_bias(q.shape[2])
    logits = jnp.einsum("bhqd,bhkd->bhqk", q * q.shape[-1] ** -0.5, k) + bias
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [5, 8, 37, 64])
def test_attention_in_query_chunks_equals_whole_attention(causal, chunk):
    rng = np.random.default_rng(chunk)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 37, 8)), jnp.float32) for _ in range(3))
    mask = rng.random((2, 37)) > 0.2
    mask[:, 0] = True
    bias = _padding_bias(mask)
    whole = _whole(q, k, v, bias, causal=causal)
    chunked = jax.jit(attention_in_query_chunks, static_argnames=("causal", "chunk"))(
        q, k, v, bias, causal=causal, chunk=chunk
    )
    np.testing.assert_allclose(chunked, whole, atol=2e-6, rtol=0)


_padding_bias = jax.jit(padding_bias)


def _chunked_and_whole(module_class, *args, **kwargs):
    """The outputs of ``module_class`` with queries in chunks of 4 and whole (chunks of 512), on
    the same parameters; one compiled program (op by op, each operation compiles on its own)."""
    chunked, whole = (module_class(d_model=16, n_heads=2, query_chunk_size=chunk) for chunk in (4, 512))

    @jax.jit
    def run(*args):
        variables = chunked.init(jax.random.key(0), *args, **kwargs)
        return chunked.apply(variables, *args, **kwargs), whole.apply(variables, *args, **kwargs)

    return run(*args)


def test_encoder_and_cross_attention_chunk_long_queries_without_changing_outputs():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 23, 16)), jnp.float32)
    encoded = jnp.asarray(rng.normal(size=(2, 19, 16)), jnp.float32)
    mask = np.ones((2, 23), bool)
    mask[1, 17:] = False
    encoder_mask = np.ones((2, 19), bool)
    encoder_mask[0, 11:] = False
    np.testing.assert_allclose(*_chunked_and_whole(SelfAttention, x, mask), atol=2e-6)
    np.testing.assert_allclose(*_chunked_and_whole(CrossAttention, x, encoded, encoder_mask), atol=2e-6)


def test_causal_prefill_in_query_chunks_fills_the_same_cache_and_outputs():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(1, 21, 16)), jnp.float32)
    prefix_mask = np.ones((1, 21), bool)
    prefix_mask[0, 18:] = False
    modules = [CausalSelfAttention(d_model=16, n_heads=2, query_chunk_size=chunk) for chunk in (4, 512)]

    @jax.jit  # one program, where op by op each operation compiles on its own
    def prefill(x, prefix_mask):
        params = modules[0].init(jax.random.key(0), x)["params"]  # the same for either chunk size
        results = []
        for module in modules:
            y, variables = module.apply(
                {"params": params}, x, decode=True, max_decode_length=32, prefix_mask=prefix_mask, mutable=["cache"]
            )
            results.append((y, variables["cache"]))
        return results

    (y_chunked, cache_chunked), (y_whole, cache_whole) = prefill(x, prefix_mask)
    np.testing.assert_allclose(y_chunked, y_whole, atol=2e-6)
    for a, b in zip(jax.tree.leaves(cache_chunked), jax.tree.leaves(cache_whole)):
        np.testing.assert_array_equal(a, b)
    # Training (no prefix) takes the same chunked path.
    np.testing.assert_allclose(*_chunked_and_whole(CausalSelfAttention, x), atol=2e-6)


native = pytest.mark.skipif(not native_kernels.available(), reason="terra's native kernels are not built")


def _operands(seed, batch, heads, lq, lk, d, masked=0.2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, heads, lq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(batch, heads, lk, d)), jnp.float32) for _ in range(2))
    mask = rng.random((batch, lk)) > masked
    mask[:, 0] = True
    return q, k, v, _padding_bias(mask)


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
    whole = _whole(q, k, v, bias, causal=causal)
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
    # Jitted: op by op each operation of the backward pass compiles on its own.
    for fast, slow in zip(jax.jit(native_grads)(q, k, v), jax.jit(xla_grads)(q, k, v)):
        np.testing.assert_allclose(fast, slow, atol=1e-5, rtol=1e-5)


@native
def test_deterministic_long_attention_runs_the_native_kernel_with_the_same_outputs():
    """A layer whose queries outnumber query_chunk_size attends them in one native call when
    deterministic (prefill, evaluation), the chunked XLA form when not: the same outputs."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 40, 32)), jnp.float32)
    mask = np.ones((2, 40), bool)
    mask[1, 30:] = False
    module = SelfAttention(d_model=32, n_heads=2, query_chunk_size=8)
    variables = jax.jit(module.init)(jax.random.key(0), x, mask)  # one program, not one per operation
    apply = jax.jit(lambda d: module.apply(variables, x, mask, deterministic=d), static_argnums=0)
    assert "terra_blocked_attention" in apply.lower(True).as_text()
    assert "terra_blocked_attention" not in apply.lower(False).as_text()
    np.testing.assert_allclose(apply(True), apply(False), atol=2e-6)
    whole_module = SelfAttention(d_model=32, n_heads=2, query_chunk_size=512)
    whole = jax.jit(lambda v, x, m: whole_module.apply(v, x, m, deterministic=True))(variables, x, mask)
    np.testing.assert_allclose(apply(True), whole, atol=2e-6)


@native
def test_native_blocked_attention_refuses_operands_that_disagree():
    """Shapes are checked before anything is read: one error naming the header that lists them."""
    q, k, v, bias = _operands(6, 1, 2, 16, 16, 16)
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(native_kernels.blocked_attention(q, k, v, bias[:, 0, 0, :8], causal=False))
    with pytest.raises(Exception, match="as many queries as keys"):
        jax.block_until_ready(native_kernels.blocked_attention(q[:, :, :8], k, v, bias[:, 0, 0], causal=True))
