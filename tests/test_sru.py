"""The low-rank SRU branch (paper §4.3; ``docs/design/reference_code.md`` §4.3 and §4.7)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.layers import axes
from terra.layers.sru import SRU_GATES, SRU_UNITS, LowRankSRU, linear_recurrence

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

D_MODEL, N_UNITS, BATCH, LENGTH = 16, 8, 2, 13  # an odd length exercises the scan's edges


def _inputs(seed=0, length=LENGTH):
    return jax.random.normal(jax.random.key(seed), (BATCH, length, D_MODEL))


@functools.lru_cache(maxsize=None)
def _params(n_layers):
    """Boxed parameters, initialised once per depth (both scan modes share them)."""
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=n_layers, parallel_scan=False)
    return jax.jit(lambda x: layer.init(jax.random.key(1), x))(_inputs())["params"]


@functools.lru_cache(maxsize=None)
def _compiled_apply(layer, decode, mutable):
    return jax.jit(lambda v, x, kw: layer.apply(v, x, decode=decode, mutable=mutable, **kw))


def _apply(layer, variables, x, *, decode=False, mutable=False, **kwargs):
    """``layer.apply``, compiled once per layer and mode (eager dispatch of the scan's many
    small ops is slow)."""
    return _compiled_apply(layer, decode, mutable)(variables, x, kwargs)


def _numpy_reference(params, x, n_layers, mask=None):
    """The formulas of ``trax/layers/rnn.py:SRU`` as a plain sequential loop, in float64."""
    p = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), nn.meta.unbox(params))
    x = np.asarray(x, np.float64)
    mask = np.ones(x.shape[:2]) if mask is None else np.asarray(mask, np.float64)

    def dense(v, q):  # output-major kernel [out, in]
        return v @ q["kernel"].T + q["bias"]

    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    centred = x - x.mean(-1, keepdims=True)
    h = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
    h = h * p["norm"]["scale"] + p["norm"]["bias"]
    h = dense(h, p["down"])
    for i in range(n_layers):
        r, f, y = np.split(dense(h, p[f"sru_{i}"]["gates"]), 3, axis=-1)
        r, f = sigmoid(r), sigmoid(f)
        c = np.zeros((x.shape[0], N_UNITS))
        out = np.zeros_like(h)
        for t in range(x.shape[1]):
            new = f[:, t] * c + (1 - f[:, t]) * y[:, t]
            m = mask[:, t, None]
            c = m * new + (1 - m) * c  # the reference's portal mask (ScanSRUCell)
            out[:, t] = c * r[:, t] + h[:, t] * (1 - r[:, t]) * np.sqrt(3.0)
        h = out
    return dense(h, p["up"])


@pytest.mark.parametrize("parallel_scan", [True, False])
def test_sru_recurrence_matches_a_sequential_reference(parallel_scan):
    n_layers = 2  # stacked SRUs (the reference's ff_use_sru=(n_layers, n_units)); 1 is the default
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=n_layers, parallel_scan=parallel_scan)
    x = _inputs()
    params = _params(n_layers)
    got = _apply(layer, {"params": params}, x)
    assert got.shape == x.shape
    np.testing.assert_allclose(got, _numpy_reference(params, x, n_layers), rtol=1e-5, atol=1e-5)

    # The associative scan alone, with a start carry, against a loop.
    a = jax.nn.sigmoid(jax.random.normal(jax.random.key(2), (BATCH, LENGTH, N_UNITS)))
    b = jax.random.normal(jax.random.key(3), (BATCH, LENGTH, N_UNITS))
    c0 = jax.random.normal(jax.random.key(4), (BATCH, N_UNITS))
    c, expected = np.asarray(c0), []
    for t in range(LENGTH):
        c = np.asarray(a[:, t]) * c + np.asarray(b[:, t])
        expected.append(c)
    got = jax.jit(linear_recurrence, static_argnames="parallel")(a, b, c0, parallel=parallel_scan)
    np.testing.assert_allclose(got, np.stack(expected, 1), rtol=1e-5, atol=1e-5)


def test_masked_positions_keep_the_carry():
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=2)
    x = _inputs()
    params = _params(2)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[0, [2, 3, 7]] = 0  # gaps in the middle
    mask[1, -4:] = 0  # trailing padding
    got = np.asarray(_apply(layer, {"params": params}, x, mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got, _numpy_reference(params, x, 2, mask), rtol=1e-5, atol=1e-5)

    # Removing the masked positions changes nothing at the kept ones: the padding neither
    # advances the carry nor leaks into later positions, whatever its content.
    for row in range(BATCH):
        kept = np.flatnonzero(mask[row])
        compact = _numpy_reference(params, x[row : row + 1, kept], 2)
        np.testing.assert_allclose(got[row, kept], compact[0], rtol=1e-5, atol=1e-5)
    noisy = x.at[0, 2].set(100.0).at[1, -1].set(-100.0)
    got_noisy = np.asarray(_apply(layer, {"params": params}, noisy, mask=jnp.asarray(mask)))
    keep = mask.astype(bool)
    np.testing.assert_allclose(got_noisy[keep], got[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded_prefix, parallel_scan", [(False, True), (True, True), (True, False)])
def test_incremental_decode_matches_full_forward(padded_prefix, parallel_scan):
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=2, parallel_scan=parallel_scan)
    x = _inputs(seed=5)
    prefill = 5
    params = _params(2)
    mask = np.ones((BATCH, LENGTH), np.int32)
    if padded_prefix:  # Terraformer's first call: [enc_real, pads, dec] with pads masked.
        mask[0, 3:5] = 0
        mask[1, 1:4] = 0
    full = _apply(layer, {"params": params}, x, mask=jnp.asarray(mask))

    # The cache-creating call (the parameters exist, the cache does not) must not advance the state.
    _, created = _apply(layer, {"params": params}, x[:, :prefill], decode=True, mutable=("cache",))
    cache = created["cache"]
    for carry in jax.tree_util.tree_leaves(cache):
        assert carry.shape == (BATCH, N_UNITS)
        np.testing.assert_array_equal(carry, 0.0)

    outputs = []
    out, mutated = _apply(
        layer,
        {"params": params, "cache": cache},
        x[:, :prefill],
        decode=True,
        mutable=("cache",),
        mask=jnp.asarray(mask[:, :prefill]),
    )
    outputs.append(out)
    cache = mutated["cache"]
    for t in range(prefill, LENGTH):
        step = x[:, t : t + 1]
        out, mutated = _apply(layer, {"params": params, "cache": cache}, step, decode=True, mutable=("cache",))
        outputs.append(out)
        cache = mutated["cache"]
    incremental = jnp.concatenate(outputs, axis=1)
    keep = mask.astype(bool)  # outputs at masked positions are not meaningful
    np.testing.assert_allclose(np.asarray(incremental)[keep], np.asarray(full)[keep], atol=1e-5, rtol=1e-5)


def test_parameters_have_logical_axis_names():
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=2)
    variables = jax.eval_shape(lambda x: layer.init(jax.random.key(1), x), _inputs())
    params = variables["params"]
    assert set(variables) == {"params"}  # no cache outside decode mode
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert len(leaves) == 2 + 2 + 2 * 2 + 2  # norm, down, 2 x gates, up
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim and all(isinstance(n, str) for n in leaf.names)
    kernels = {
        path: names
        for path, names in jax.tree_util.tree_flatten_with_path(nn.get_partition_spec(params))[0]
        if path[-1].key == "kernel"
    }
    by_module = {path[0].key: tuple(spec) for path, spec in kernels.items()}
    assert by_module == {
        "down": (SRU_UNITS, axes.EMBED),
        "sru_0": (SRU_GATES, SRU_UNITS),
        "sru_1": (SRU_GATES, SRU_UNITS),
        "up": (axes.EMBED, SRU_UNITS),
    }
    # Every name resolves under the default rules extended with the SRU names (replicated).
    rules = axes.default_axis_rules(additional_rules=((SRU_UNITS, None), (SRU_GATES, None)))
    for leaf in leaves:
        assert None not in leaf.names
        assert nn.logical_to_mesh_axes(leaf.names, rules) is not None


def test_gradients_flow_through_the_scan():
    layer = LowRankSRU(d_model=D_MODEL, n_units=N_UNITS, n_layers=2)
    x = _inputs()
    params = nn.meta.unbox(_params(2))
    target = jax.random.normal(jax.random.key(6), x.shape[::2])

    def last_output(p, x_in):
        # Only the last position is scored, so the input gradient at position 0 exists only
        # if the carries transport it back through the whole scan (of both layers).
        return jnp.sum(layer.apply({"params": p}, x_in)[:, -1] * target)

    grads, x_grad = jax.jit(jax.grad(last_output, argnums=(0, 1)))(params, x)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.all(np.isfinite(g)), path
        assert np.any(np.abs(g) > 0), path
    assert np.all(np.isfinite(x_grad)) and np.all(np.abs(x_grad[:, 0]).sum(-1) > 0)
