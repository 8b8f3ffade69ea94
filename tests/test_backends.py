"""The decode backends (terra/backends): a primitive runs a backend's form only in the program
lowered for that backend's platform and its XLA form everywhere else, a backend added for a
platform is consulted without any layer changing, and a fused step a backend declines leaves the
layer to compose its step from the other primitives."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra import backends
from terra.backends import primitives
from terra.quantization import dequantize, quantize

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

PRIMITIVES_WITH_NATIVE_FORMS = (
    "output_major_product",
    "float_output_major_product",
    "input_major_product",
    "gathered_rows_product",
    "gathered_rows_sum",
    "sparse_feed_forward_step",
    "sparse_attention_step",
    "lsh_bucket_attention",
    "blocked_attention",
    "lsh_chunk_attention",
)


def _backend(**forms):
    """A backend with the given forms (``facts -> form``) and no other."""
    backend = {name: (lambda *facts: None) for name in PRIMITIVES_WITH_NATIVE_FORMS}
    backend.update(forms, transposed_chunk_rows=lambda x: None)
    return types.SimpleNamespace(**backend)


def _marked(x, values, scale):
    """A form no product computes: 7 in every output."""
    del scale
    return jnp.full(x.shape[:-1] + (values.shape[0],), 7.0, x.dtype)


@pytest.mark.parametrize("platform, runs", [("cpu", "backend"), ("tpu", "xla")])
def test_a_backend_added_for_a_platform_runs_only_in_the_program_lowered_for_it(platform, runs, monkeypatch):
    monkeypatch.setattr(primitives, "BACKENDS", {platform: _backend(output_major_product=lambda *facts: _marked)})
    x = jax.random.normal(jax.random.key(0), (2, 24))
    q = quantize(jax.random.normal(jax.random.key(1), (5, 24)), "int8")
    # A new function: jit's trace cache is keyed by the function, and BACKENDS is read when tracing.
    got = np.asarray(jax.jit(lambda x, q: backends.output_major_product(x, q))(x, q))
    if runs == "backend":
        np.testing.assert_array_equal(got, np.full((2, 5), 7.0))
    else:
        np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(dequantize(q)).T, rtol=1e-5, atol=1e-5)


def test_float_weights_reach_only_a_backends_float_product(monkeypatch):
    # The narrow product's form is never asked about float weights; the float product's form is,
    # and where it has none the product is XLA's.
    asked = []

    def refuse(*facts):
        raise AssertionError("a backend's narrow product was asked about float weights")

    def float_form(x, kernel):
        asked.append((x.shape, kernel.shape))

    monkeypatch.setattr(
        primitives, "BACKENDS", {"cpu": _backend(output_major_product=refuse, float_output_major_product=float_form)}
    )
    x, w = jnp.ones((2, 8)), jnp.ones((3, 8))
    np.testing.assert_array_equal(backends.output_major_product(x, w), np.full((2, 3), 8.0))
    assert asked == [((2, 8), (3, 8))]


def _feed_forward_weights(kind):
    d, n_blocks, n_units, low = 16, 4, 8, 4
    keys = jax.random.split(jax.random.key(0), 4)
    weights = backends.SparseFeedForwardWeights(
        jax.random.normal(keys[0], (low, d)),
        jax.random.normal(keys[1], (low, n_blocks, n_units)),
        jnp.zeros((n_blocks, n_units)),
        jax.random.normal(keys[2], (n_blocks, n_units, d)),
        jax.random.normal(keys[3], (n_blocks, n_units, d)),
        jnp.zeros((d,)),
    )
    if kind == "float32":
        return weights
    return weights._replace(
        controller_down=quantize(weights.controller_down, kind),
        controller_up=quantize(weights.controller_up, kind, transposed=True),
        wi=quantize(weights.wi, kind),
        wo=quantize(weights.wo, kind),
    )


def _unfused(x):
    return x + 1.0, jnp.zeros(x.shape[:-1] + (4,), jnp.int32)


def test_a_fused_step_no_backend_offers_is_left_to_the_layer(monkeypatch):
    x = jnp.ones((1, 1, 16))
    assert backends.sparse_feed_forward_step(x, _feed_forward_weights("float32"), _unfused) is None
    monkeypatch.setattr(primitives, "BACKENDS", {})
    assert backends.sparse_feed_forward_step(x, _feed_forward_weights("int8"), _unfused) is None


@pytest.mark.parametrize("platform, runs", [("cpu", "backend"), ("tpu", "unfused")])
def test_a_fused_step_runs_the_unfused_step_on_platforms_without_the_fused_form(platform, runs, monkeypatch):
    def fused(x, down, up, wi, wo):
        return x * 0.0 + 7.0, jnp.ones(x.shape[:-1] + (4,), jnp.int32)

    backend = _backend(sparse_feed_forward_step=lambda x, weights: fused)
    monkeypatch.setattr(primitives, "BACKENDS", {platform: backend})
    step = jax.jit(lambda x, w: backends.sparse_feed_forward_step(x, w, _unfused))
    y, chosen = step(jnp.ones((1, 1, 16)), _feed_forward_weights("int8"))
    want_y, want_chosen = (7.0, 1) if runs == "backend" else (2.0, 0)
    np.testing.assert_array_equal(y, np.full((1, 1, 16), want_y))
    np.testing.assert_array_equal(chosen, np.full((1, 1, 4), want_chosen))
