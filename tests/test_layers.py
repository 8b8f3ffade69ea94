"""Layer-level behaviour: projections, normalisation, positions, dropout placement, axes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.layers import (
    Dense,
    FeedForward,
    HalfResidual,
    LayerNorm,
    MixtureOfExpertsFeedForward,
    SparseFeedForward,
    TrainablePositionalEmbedding,
    axes,
)
from terra.layers.positional import sinusoid_table
from terra.layers.sparse_feedforward import chunk_layout, to_chunks

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


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


# Every layer whose output dropout TransformerConfig.share_dropout_over_length governs; the
# sparse layers choose deterministically (temperature 0, always the hard mask), so that dropout
# is the only thing that can tell identical tokens apart.
DROPOUT_SITES = {
    "feed_forward": lambda share: FeedForward(8, 32, dropout_rate=0.5, share_dropout_over_length=share),
    "sparse_feed_forward": lambda share: SparseFeedForward(
        8, 32, dropout_rate=0.5, ff_sparsity=4, temperature=0.0, quant_prob=1.0, share_dropout_over_length=share
    ),
    "sparse_feed_forward_chunked": lambda share: SparseFeedForward(
        8,
        32,
        dropout_rate=0.5,
        ff_sparsity=4,
        temperature=0.0,
        quant_prob=1.0,
        share_dropout_over_length=share,
        ff_chunk_size=3,
    ),
    "mixture_of_experts": lambda share: MixtureOfExpertsFeedForward(
        8, 32, dropout_rate=0.5, n_experts=4, temperature=0.0, hard_prob=1.0, share_dropout_over_length=share
    ),
    "half_residual": lambda share: HalfResidual(
        FeedForward(8, 32), pre_norm=False, dropout_rate=0.5, share_dropout_over_length=share
    ),
}


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("site", sorted(DROPOUT_SITES))
@pytest.mark.slow
def test_dropout_mask_shared_over_length_only_when_configured(site, share):
    layer = DROPOUT_SITES[site](share)
    row = jax.random.normal(jax.random.key(0), (1, 1, 8))
    x = jnp.tile(row, (2, 6, 1))  # two examples, identical tokens at every position
    variables = layer.init(jax.random.key(0), x)

    def run(deterministic):
        out = layer.apply(variables, x, deterministic=deterministic, rngs={"dropout": jax.random.key(3)})
        return out[0] if isinstance(out, tuple) else out

    train, eval_out = run(False), run(True)
    assert not np.allclose(train, eval_out)  # dropout is on
    kept = np.asarray(train != 0).reshape(12, 8)  # the mask of each of the 12 tokens
    if site == "sparse_feed_forward_chunked":
        # As the reference's Dropout(shared_axes=[-2]) on each flattened [chunk, d] chunk: with
        # sharing, one mask per chunk of 3 tokens (to_chunks' strided layout), 4 chunks.
        groups = np.asarray(to_chunks(jnp.arange(12), *chunk_layout(12, 3)))
    elif site == "sparse_feed_forward":
        groups = np.arange(12)[None]  # unchunked: one mask for all the tokens of the call
    else:
        groups = np.arange(12).reshape(2, 6)  # one mask per example
    same = [np.all(kept[g] == kept[g[0]]) for g in groups]
    if share:
        assert all(same)
        values = np.asarray(train).reshape(12, 8)[groups[0]]  # identical tokens, one mask: equal outputs
        np.testing.assert_allclose(values, np.broadcast_to(values[:1], values.shape), rtol=1e-6)
        assert len({kept[g[0]].tobytes() for g in groups}) == len(groups)  # a mask of its own per group
    else:  # one mask per position: identical tokens come out different
        assert not any(same)


def test_dense_feed_forward_inner_dropout_is_shared_over_length_either_way():
    # The reference's _FeedForward hard-codes shared_axes=[-2] for ff_dropout.
    ff = FeedForward(d_model=8, d_ff=32, ff_dropout_rate=0.5, share_dropout_over_length=False)
    x = jnp.tile(jax.random.normal(jax.random.key(0), (1, 1, 8)), (1, 6, 1))
    variables = ff.init(jax.random.key(0), x)
    train = ff.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_allclose(train, jnp.tile(train[:, :1], (1, 6, 1)), rtol=1e-6)
    assert not np.allclose(train, ff.apply(variables, x, deterministic=True))


@pytest.mark.slow
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
