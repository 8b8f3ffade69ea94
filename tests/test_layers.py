"""Layer-level behaviour: projections, normalisation, positions, dropout placement, axes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.layers import Dense, FeedForward, LayerNorm, TrainablePositionalEmbedding, axes
from terra.layers.positional import sinusoid_table


def test_dense_contracts_trailing_axes_with_output_major_kernel():
    layer = Dense((3, 5), kernel_axes=(axes.HEADS, axes.KV, axes.EMBED, axes.MLP), n_contract=2)
    x = jax.random.normal(jax.random.key(1), (2, 7, 4, 6))
    variables = layer.init(jax.random.key(0), x)
    params = nn.unbox(variables)["params"]
    assert params["kernel"].shape == (3, 5, 4, 6)
    expected = jnp.einsum("blij,hkij->blhk", x, params["kernel"]) + params["bias"]
    np.testing.assert_allclose(layer.apply(variables, x), expected, rtol=1e-5, atol=1e-5)


def test_dense_rejects_axis_names_that_do_not_match_its_rank():
    layer = Dense(8, kernel_axes=(axes.MLP,))
    with pytest.raises(ValueError, match="kernel_axes"):
        layer.init(jax.random.key(0), jnp.ones((2, 4)))


def test_layer_norm_normalises_the_feature_axis():
    x = jax.random.normal(jax.random.key(0), (3, 5, 16)) * 4 + 2
    y = LayerNorm().apply(LayerNorm().init(jax.random.key(0), x), x)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)


def test_positional_table_starts_as_sin_cos_and_decode_counts_positions():
    layer = TrainablePositionalEmbedding(max_len=10)
    x = jnp.zeros((1, 4, 8))
    variables = layer.init(jax.random.key(0), x)
    table = nn.unbox(variables)["params"]["pos_embedding"]
    np.testing.assert_allclose(table[3, 0], np.sin(3.0), rtol=1e-6)
    np.testing.assert_allclose(table[3, 1], np.cos(3.0), rtol=1e-6)
    np.testing.assert_allclose(table, sinusoid_table(10, 8))
    full = layer.apply(variables, x)
    # Decode: create the cache, then one position per call.
    _, cache = layer.apply(variables, x[:, :1], decode=True, mutable=["cache"])
    for t in range(4):
        out, cache = layer.apply({**variables, **cache}, x[:, t : t + 1], decode=True, mutable=["cache"])
        np.testing.assert_allclose(out[:, 0], full[:, t])


def test_positional_embedding_rejects_sequences_longer_than_its_table():
    layer = TrainablePositionalEmbedding(max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        layer.init(jax.random.key(0), jnp.zeros((1, 5, 8)))


def test_positional_offsets_shift_the_table_in_training_only():
    layer = TrainablePositionalEmbedding(64, start_from_zero_prob=0.5, max_offset=20)
    x = jnp.zeros((2, 8, 6))
    variables = layer.init(jax.random.key(0), x)
    table = np.asarray(nn.unbox(variables)["params"]["pos_embedding"])
    np.testing.assert_array_equal(layer.apply(variables, x), table[None, :8].repeat(2, 0))  # eval: from 0
    starts = set()
    for seed in range(40):
        y = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
        start = int(np.argmin(np.abs(table - np.asarray(y[0, 0])).sum(axis=1)))  # sin/cos rows are distinct
        np.testing.assert_array_equal(y[1], table[start : start + 8])  # one offset per batch
        starts.add(start)
    assert 0 in starts and len(starts) > 5 and max(starts) < 20
    again = layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(
        again, layer.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    )


def test_feed_forward_dropout_masks_are_shared_over_length():
    ff = FeedForward(d_model=8, d_ff=32, dropout_rate=0.5, ff_dropout_rate=0.5)
    row = jax.random.normal(jax.random.key(0), (1, 1, 8))
    x = jnp.tile(row, (1, 6, 1))  # identical tokens at every position
    variables = ff.init(jax.random.key(0), x)
    train = ff.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_allclose(train, jnp.tile(train[:, :1], (1, 6, 1)), rtol=1e-6)
    assert not np.allclose(train, ff.apply(variables, x, deterministic=True))


def test_every_model_parameter_has_logical_axis_names(tiny_model):
    model, _ = tiny_model
    boxed = model.abstract_variables()["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert leaves
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned), leaf
        assert len(leaf.names) == leaf.value.ndim
        assert all(isinstance(n, str) for n in leaf.names)


def test_default_axis_rules_cover_every_parameter_axis(tiny_model):
    model, _ = tiny_model
    rules = dict(axes.default_axis_rules())
    boxed = model.abstract_variables()["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert {n for leaf in leaves for n in leaf.names} <= set(rules)
