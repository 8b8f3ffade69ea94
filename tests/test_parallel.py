"""Meshes, logical-to-mesh parameter and optimizer-state shardings, global batches.

Written for any even number of forced CPU devices (tests/conftest.py): the mesh is
``data = devices // 2`` x ``model = 2``. Two processes forming one mesh through gloo are tested by
the gloo workers of tests/test_parallel_equivalence.py, which then train on it.
"""

import logging

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from terra.errors import ConfigError
from terra.layers.axes import default_axis_rules
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer
from terra.parallel.mesh import describe_mesh, initialize_distributed, make_mesh
from terra.parallel.sharding import (
    batch_sharding,
    describe_shardings,
    global_batch,
    opt_state_shardings,
    param_shardings,
    sharded_init,
)

from helpers import tiny_config

N_DEVICES = len(jax.devices())
DATA = N_DEVICES // 2
WI = ("encoder_0", "feed_forward", "wi", "kernel")  # ("mlp", "embed"): [d_ff=64, d_model=32]
WO = ("decoder_1", "feed_forward", "wo", "kernel")  # ("embed", "mlp"): [d_model=32, d_ff=64]
QKV = ("encoder_1", "attention", "qkv", "kernel")  # ("heads", "qkv", "kv", "embed"): [4, 3, 8, 32]
EMBEDDING = ("token_embedding", "embedding")  # ("vocab", "embed"): [61, 32]


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _shard_shapes(array):
    return {tuple(shard.data.shape) for shard in array.addressable_shards}


def _abstract(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


# XLA's optimisation passes dominate this file's time and do not change what it proves; every
# array compared below is computed under the same setting, so values match exactly.
# Meshes over eight devices: these tests run in make test's multi_device session (conftest), each
# compiling 8-way programs, hence slow.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.multi_device, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_model(fast_compile):
    """The conftest tiny model and its unsharded parameters, compiled under ``fast_compile``."""
    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config()))
    return model, model.init_params(jax.random.key(0))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(data=DATA, model=2)


@pytest.fixture(scope="module")
def sharded(tiny_model, mesh):
    """The tiny model's parameter shardings and its parameters created with them."""
    model, _ = tiny_model
    shardings = param_shardings(model.abstract_variables(), mesh)
    return shardings, sharded_init(model.init_params, jax.random.key(0), shardings)


def test_make_mesh_uses_auto_axes_and_rejects_a_bad_shape():
    mesh = make_mesh(data=-1, model=2)
    assert dict(mesh.shape) == {"data": DATA, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert describe_mesh(mesh) == f"mesh data={DATA} x model=2 over {N_DEVICES} cpu devices, 1 process"

    # Auto axes are what let Linen's logical constraints run (under Explicit axes they assert).
    with jax.set_mesh(mesh), nn.logical_axis_rules(default_axis_rules()):
        y = jax.jit(lambda x: nn.with_logical_constraint(x * 2, ("batch", "mlp")))(jnp.ones((DATA, 4)))
    assert y.sharding.spec == P("data", "model")

    with pytest.raises(ConfigError, match=f"{N_DEVICES} devices.*data={N_DEVICES // 2}, model=2"):
        make_mesh(data=N_DEVICES, model=2)
    with pytest.raises(ConfigError, match="model=3 does not divide"):
        make_mesh(model=3)

    gin.parse_config("terra.parallel.make_mesh.model = 2")
    assert dict(make_mesh().shape) == {"data": DATA, "model": 2}


def test_parameters_are_sharded_as_the_rules_say(tiny_model, mesh, sharded, caplog):
    shardings, params = sharded
    wi, wo, qkv = _get(params, WI), _get(params, WO), _get(params, QKV)
    assert wi.sharding.spec == P("model", None) and _shard_shapes(wi) == {(32, 32)}
    assert wo.sharding.spec == P(None, "model") and _shard_shapes(wo) == {(32, 32)}
    assert qkv.sharding.spec == P("model", None, None, None) and _shard_shapes(qkv) == {(2, 3, 8, 32)}
    scale = params["encoder_norm"]["scale"]
    assert scale.sharding.spec == P(None) and _shard_shapes(scale) == {(32,)}
    assert jax.tree.structure(shardings) == jax.tree.structure(params)

    # vocab=61 cannot be split over model=2: replicated with a warning, or an error if strict.
    embedding = _get(params, EMBEDDING)
    assert embedding.sharding.spec == P(None, None) and _shard_shapes(embedding) == {(61, 32)}
    model, _ = tiny_model
    with caplog.at_level(logging.WARNING, logger="terra.parallel.sharding"):
        param_shardings(model.abstract_variables(), mesh)
    assert "['token_embedding']['embedding']" in caplog.text
    with pytest.raises(ConfigError, match="token_embedding"):
        param_shardings(model.abstract_variables(), mesh, strict=True)

    # A bare boxed params collection and custom rules work too.
    fsdp = param_shardings(model.abstract_variables()["params"], mesh, default_axis_rules(shard_embed=True))
    assert _get(fsdp, WI).spec == P("model", "data")

    table = describe_shardings(params, shardings, limit=3)
    # The fused qkv kernels ([4, 3, 8, 32] = 3072 values) are the largest.
    assert table.splitlines()[0].startswith(f"{len(jax.tree.leaves(params))} parameters")
    assert len(table.splitlines()) == 5
    assert all("['qkv']['kernel']" in line and "(4, 3, 8, 32)" in line for line in table.splitlines()[2:])


def _leaves_named(state, name):
    """``{param path: leaf}`` for the state leaves under a ``name`` attribute (e.g. ``v_row``)."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", None))) for k in path]
        if name in keys:
            found[tuple(keys[keys.index(name) + 1 :])] = leaf
    return found


def _assert_rank_correct(state):
    for leaf in jax.tree.leaves(state):
        assert len(leaf.sharding.spec) <= leaf.ndim


def test_adafactor_state_shardings_drop_the_factored_axis(tiny_model, mesh, sharded):
    model, _ = tiny_model
    shardings, params = sharded
    # The tiny model's dims are below optax's default min_dim_size_to_factor=128.
    optimizer = optax.adafactor(
        learning_rate=1e-2, multiply_by_parameter_scale=True, decay_rate=0.8, momentum=None, min_dim_size_to_factor=16
    )
    state_shardings = opt_state_shardings(optimizer, _abstract(params), shardings, mesh)
    state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
    _assert_rank_correct(state)
    # The boxed tree (whose boxes optax would copy onto v_row/v_col at the wrong rank) gives the
    # same answer, also with a mesh set.
    with jax.set_mesh(mesh):
        from_boxes = opt_state_shardings(optimizer, model.abstract_variables()["params"], shardings, mesh)
    assert from_boxes == state_shardings

    # wi: [d_ff=64, d_model=32] with P("model", None). optax reduces the largest dim (0) for
    # v_row and the second largest (1) for v_col.
    v_row, v_col = _leaves_named(state, "v_row")[WI], _leaves_named(state, "v_col")[WI]
    assert v_row.shape == (32,) and v_row.sharding.spec == P(None)
    assert v_col.shape == (64,) and v_col.sharding.spec == P("model") and _shard_shapes(v_col) == {(32,)}
    # wo: [32, 64] with P(None, "model"): v_row drops dim 1, v_col drops dim 0.
    v_row, v_col = _leaves_named(state, "v_row")[WO], _leaves_named(state, "v_col")[WO]
    assert v_row.shape == (32,) and v_row.sharding.spec == P(None)
    assert v_col.shape == (64,) and v_col.sharding.spec == P("model")
    # Unfactored 1-D params keep a full-shape v with the param's sharding.
    v_bias = _leaves_named(state, "v")[("encoder_0", "feed_forward", "wi", "bias")]
    assert v_bias.shape == (64,) and v_bias.sharding.spec == P("model")

    # One sharded update step keeps the layout.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, new_state = jax.jit(optimizer.update, out_shardings=(shardings, state_shardings))(grads, state, params)
    assert _get(updates, WI).sharding.spec == P("model", None)
    assert np.all(np.isfinite(np.asarray(_get(updates, WI))))
    assert _leaves_named(new_state, "v_col")[WI].sharding.spec == P("model")


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: optax.adamw(1e-3),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        lambda: optax.inject_hyperparams(optax.adafactor, static_args=("min_dim_size_to_factor",))(
            learning_rate=1e-2, min_dim_size_to_factor=16
        ),
        lambda: optax.sgd(1e-2, momentum=0.9),
    ],
    ids=["adamw", "clip_chain_adamw", "inject_hyperparams_adafactor", "sgd_momentum"],
)
def test_optimizer_state_mirrors_the_parameter_shardings(make_optimizer, mesh, sharded):
    shardings, params = sharded
    optimizer = make_optimizer()
    state_shardings = opt_state_shardings(optimizer, _abstract(params), shardings, mesh)
    state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
    _assert_rank_correct(state)
    moments = {**_leaves_named(state, "mu"), **_leaves_named(state, "trace"), **_leaves_named(state, "v_col")}
    assert moments[WI].sharding.spec in (P("model", None), P("model"))
    scalars = [leaf for leaf in jax.tree.leaves(state) if leaf.ndim == 0]
    assert all(leaf.sharding.spec == P() for leaf in scalars)


def test_global_batch_is_sharded_over_data(mesh):
    rows = 2 * DATA
    host = {
        "encoder_input_tokens": np.arange(rows * 8, dtype=np.int32).reshape(rows, 8),
        "decoder_target_tokens": np.ones((rows, 6), np.int32),
    }
    batch = global_batch(host, mesh)
    tokens = batch["encoder_input_tokens"]
    assert tokens.shape == (rows, 8) and tokens.sharding == batch_sharding(mesh)
    assert tokens.sharding.spec == P("data") and _shard_shapes(tokens) == {(2, 8)}
    np.testing.assert_array_equal(np.asarray(tokens), host["encoder_input_tokens"])
    # Shard i holds rows [2i, 2i+2): the batch really is split along its leading axis.
    for shard in tokens.addressable_shards:
        np.testing.assert_array_equal(shard.data, host["encoder_input_tokens"][shard.index])

    with pytest.raises(ConfigError, match=f"global batch size {rows + 1} .* data axis size {DATA}"):
        global_batch({"encoder_input_tokens": np.zeros((rows + 1, 8), np.int32)}, mesh)


def test_sharded_init_matches_unsharded_init(tiny_model, sharded):
    _, reference = tiny_model
    _, params = sharded
    assert jax.tree.structure(params) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_loss_matches_unsharded_loss(tiny_model, mesh, sharded):
    model, reference = tiny_model
    _, params = sharded
    rng = np.random.default_rng(0)
    host = {
        "encoder_input_tokens": rng.integers(1, 61, (2 * DATA, 8), dtype=np.int32),
        "decoder_target_tokens": rng.integers(1, 61, (2 * DATA, 6), dtype=np.int32),
    }
    with jax.set_mesh(mesh), nn.logical_axis_rules(default_axis_rules()):
        loss, _ = jax.jit(model.loss_fn)(params, global_batch(host, mesh))
    expected, _ = jax.jit(model.loss_fn)(reference, {k: jnp.asarray(v) for k, v in host.items()})
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_initialize_distributed_without_settings_is_a_no_op(monkeypatch):
    for name in ("TERRA_COORDINATOR", "TERRA_NUM_PROCESSES", "TERRA_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    initialize_distributed()
    initialize_distributed()
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1


def test_initialize_distributed_rejects_a_malformed_environment_variable(monkeypatch):
    monkeypatch.setenv("TERRA_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="TERRA_NUM_PROCESSES='two' must be an integer"):
        initialize_distributed()
    assert not jax.distributed.is_initialized()
