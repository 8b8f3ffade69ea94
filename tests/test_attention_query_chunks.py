"""Long-input prefill: attention computed a chunk of queries at a time equals the whole
computation (issue 40: a 15,360-token prefill never holds [heads, L, L] scores whole)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
