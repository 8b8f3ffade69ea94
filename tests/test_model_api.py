"""Loss, log-perplexity and gradients of the model wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.models import shift_right
from terra.models.losses import weighted_cross_entropy

from cheap_init_prng import init_key

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _batch(vocab, batch=2, input_length=7, target_length=6, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, vocab, size=(batch, input_length)).astype(np.int32)
    targets = rng.integers(2, vocab, size=(batch, target_length)).astype(np.int32)
    targets[1, 3:] = 0  # padded targets
    return {"encoder_input_tokens": jnp.asarray(inputs), "decoder_target_tokens": jnp.asarray(targets)}


def test_shift_right_starts_with_the_start_token():
    np.testing.assert_array_equal(shift_right(jnp.array([[5, 6, 7]])), [[0, 5, 6]])


def test_weighted_cross_entropy_masks_padding_and_matches_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (2, 4, 11))
    targets = jnp.array([[3, 4, 0, 0], [1, 2, 3, 4]])
    loss_sum, weight_sum = weighted_cross_entropy(logits, targets)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    mask = targets != 0
    np.testing.assert_allclose(loss_sum, jnp.sum(nll * mask), rtol=1e-6)
    assert float(weight_sum) == 6.0


@pytest.mark.slow
def test_loss_ignores_what_the_model_predicts_at_padded_targets(tiny_model):
    model, params = tiny_model
    batch = _batch(model.config.vocab_size)
    loss, metrics = jax.jit(model.loss_fn)(params, batch)
    logits = jax.jit(model.logits)(params, batch)
    targets = batch["decoder_target_tokens"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    mask = targets != 0
    np.testing.assert_allclose(metrics["loss_sum"], jnp.sum(nll * mask), rtol=1e-5)
    np.testing.assert_allclose(loss, jnp.sum(nll * mask) / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(model.log_perplexity(params, batch), float(loss), rtol=1e-5)


def test_explicit_loss_weights_override_the_padding_mask(tiny_model):
    model, params = tiny_model
    batch = _batch(model.config.vocab_size)
    weights = jnp.zeros_like(batch["decoder_target_tokens"], jnp.float32).at[:, 0].set(1.0)
    _, metrics = jax.jit(model.loss_fn)(params, {**batch, "decoder_loss_weights": weights})
    assert float(metrics["weight_sum"]) == 2.0


def test_random_model_log_perplexity_is_near_log_vocab(tiny_model):
    model, params = tiny_model
    value = model.log_perplexity(params, _batch(model.config.vocab_size))
    assert abs(value - np.log(model.config.vocab_size)) < 1.0


@pytest.mark.slow
def test_every_parameter_gets_a_finite_gradient(tiny_model):
    model, params = tiny_model
    batch = _batch(model.config.vocab_size, input_length=64, target_length=64)  # touch every position row
    grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch)[0]))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for path, g in flat:
        assert np.all(np.isfinite(g)), path
        assert np.any(g != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_init_params_computes_the_jitted_initializer_and_the_abstract_tree_is_its_shapes(tiny_model):
    # The build traces the initializer with one layer per stack for the abstract tree, which the
    # whole initializer's trace equals; init_params traces and compiles the whole initializer once
    # (without XLA's optimization passes at this size: the same values up to float32 rounding),
    # for any key type and inside a caller's trace.
    from flax import linen as nn

    from terra.layers import initializers

    model, params = tiny_model
    reference = nn.unbox(jax.jit(model.init_variables)(jax.random.key(0)))["params"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params, reference)
    assert jax.eval_shape(model.init_variables, jax.random.key(0)) == model.abstract_variables()
    # A raw uint32 key draws what its typed key draws (from the compiled initializer the build's
    # trace made); another PRNG's key compiles an initializer of its own.
    jax.tree.map(
        np.testing.assert_array_equal, model.init_params(jax.random.PRNGKey(1)), model.init_params(jax.random.key(1))
    )
    assert jax.tree.structure(model.init_params(init_key(1))) == jax.tree.structure(params)
    traced = jax.eval_shape(model.init_params, jax.random.key(0))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), traced) == jax.tree.map(lambda x: (x.shape, x.dtype), params)
    assert sum(x.size for x in jax.tree.leaves(params)) <= initializers.INITIALIZER_UNOPTIMIZED_PARAMETERS
    compiled = initializers.compile_initializer(jax.jit(model.init_variables).trace(jax.random.key(0)))
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(compiled(jax.random.key(0)))["params"], params)
