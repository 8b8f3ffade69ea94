"""The dense encoder-decoder: incremental decoding equals the full forward pass, causality,
padding invariance, and a decode step that compiles once and updates its cache in place."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.models import shift_right

from helpers import dropout_calls, full_and_stepped_logits, tiny_config

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


# (batch, input length, target length) of the bfloat16 test and the causality checks: one compiled
# float32 forward serves them all.
SHARED_SHAPE = (2, 7, 5)


def _padded_batch(batch: int, input_length: int, target_length: int, vocab: int, seed: int = 0):
    """Host arrays, changed on the host: each jnp op on them would compile a program of its own."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, vocab, size=(batch, input_length)).astype(np.int32)
    for row in range(1, batch):  # rows 1.. end in 2, 4, ... pad tokens
        inputs[row, input_length - 2 * row :] = 0
    targets = rng.integers(2, vocab, size=(batch, target_length)).astype(np.int32)
    return inputs, targets


_shift_right = jax.jit(shift_right)  # one program per shape, not one per operation


def _decoder_inputs(targets):
    return np.asarray(_shift_right(targets))


@functools.lru_cache(maxsize=None)
def _jitted_forward(module):
    return jax.jit(
        lambda params, inputs, decoder_inputs, mask: module.apply({"params": params}, inputs, decoder_inputs, mask)
    )


def _full_logits(model, params, inputs, decoder_inputs, encoder_mask=None):
    return np.asarray(_jitted_forward(model.module)(params, inputs, decoder_inputs, encoder_mask))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.slow
def test_incremental_decode_matches_full_forward(tiny_model, batch):
    model, params = tiny_model
    inputs, targets = _padded_batch(batch, 9, 7, model.config.vocab_size)
    decoder = model.decoder(12)  # cache longer than the sequence: unused slots are masked

    full, stepped = full_and_stepped_logits(model, decoder, params, inputs, targets)
    np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=1e-5)


def test_changing_a_later_decoder_token_keeps_earlier_logits(tiny_model):
    model, params = tiny_model
    inputs, targets = _padded_batch(*SHARED_SHAPE, model.config.vocab_size)
    decoder_inputs = _decoder_inputs(targets)
    changed = decoder_inputs.copy()
    changed[:, 3] = (changed[:, 3] + 7) % model.config.vocab_size
    a = _full_logits(model, params, inputs, decoder_inputs)
    b = _full_logits(model, params, inputs, changed)
    np.testing.assert_allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not np.allclose(a[:, 3:], b[:, 3:], atol=1e-4)


def test_changing_encoder_pad_tokens_changes_nothing(tiny_model):
    model, params = tiny_model
    inputs, targets = _padded_batch(3, 10, 6, model.config.vocab_size)
    mask = inputs != 0
    noise = np.random.default_rng(5).integers(2, model.config.vocab_size, size=inputs.shape, dtype=np.int32)
    garbage = np.where(mask, inputs, noise)  # different tokens under the padding mask
    decoder_inputs = _decoder_inputs(targets)
    a = _full_logits(model, params, inputs, decoder_inputs, mask)
    b = _full_logits(model, params, garbage, decoder_inputs, mask)
    np.testing.assert_allclose(a, b, atol=1e-6)
    # ... and decoding from the garbage-padded inputs gives the same logits too.
    decoder = model.decoder(6)
    cache = decoder.prefill(params, garbage, mask)
    logits, _ = decoder.step(params, cache, decoder_inputs[:, 0])
    np.testing.assert_allclose(logits, a[:, 0], atol=1e-5)


def test_changing_a_real_encoder_token_changes_the_logits(tiny_model):
    model, params = tiny_model
    inputs, targets = _padded_batch(*SHARED_SHAPE, model.config.vocab_size)
    changed = inputs.copy()
    changed[0, 2] = (changed[0, 2] + 3) % model.config.vocab_size
    decoder_inputs = _decoder_inputs(targets)
    a = _full_logits(model, params, inputs, decoder_inputs)
    b = _full_logits(model, params, changed, decoder_inputs)
    assert not np.allclose(a, b, atol=1e-4)


def test_prefill_creates_caches_without_advancing_them(tiny_model):
    model, params = tiny_model
    inputs, _ = _padded_batch(2, 5, 1, model.config.vocab_size)
    cache = model.decoder(16).prefill(params, inputs)
    layer = cache["decoder_0"]["self_attention"]["kv"]
    assert int(layer.index) == 0
    assert layer.key.shape == (2, model.config.n_heads, 16, model.config.d_head)
    assert not np.any(np.asarray(layer.key))
    assert int(cache["decoder_positions"]["position"].index) == 0
    assert cache["decoder_0"]["cross_attention"]["kv"].key.shape == (
        2,
        model.config.n_heads,
        5,
        model.config.d_head,
    )


def test_decode_step_compiles_once_and_updates_its_cache_in_place(tiny_model):
    model, params = tiny_model
    decoder = model.decoder(37)  # a length no other array in the step has
    inputs, _ = _padded_batch(1, 6, 1, model.config.vocab_size)
    cache = decoder.prefill(params, inputs)
    token = jnp.zeros((1,), jnp.int32)
    for _ in range(5):
        logits, cache = decoder.step(params, cache, token)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    assert decoder.step._cache_size() == 1
    hlo = decoder.step.lower(params, cache, token).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    cache_copies = [line for line in entry.splitlines() if re.search(r"\bcopy\(", line) and ",37," in line]
    assert not cache_copies, "the donated KV cache is copied inside the step:\n" + "\n".join(cache_copies)


def test_decode_rejects_more_tokens_than_the_positional_table():
    from terra.decoding import IncrementalDecoder
    from terra.models import EncoderDecoderTransformer

    with pytest.raises(ValueError, match="max_len"):
        IncrementalDecoder(EncoderDecoderTransformer(tiny_config(max_len=8)), max_decode_length=9)


@pytest.mark.slow
def test_dropout_is_active_only_with_a_dropout_rng(tiny_model):
    from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config(dropout=0.3, attention_dropout=0.3)))
    _, params = tiny_model  # dropout adds no parameters: the shared tiny model's tree
    inputs, targets = _padded_batch(2, 6, 5, model.config.vocab_size)
    batch = {"encoder_input_tokens": inputs, "decoder_target_tokens": targets}
    logits = jax.jit(model.logits)
    eval_a = logits(params, batch)
    np.testing.assert_array_equal(eval_a, logits(params, batch))
    train_a = logits(params, batch, dropout_rng=jax.random.key(1))
    train_b = logits(params, batch, dropout_rng=jax.random.key(2))
    assert not np.allclose(train_a, eval_a) and not np.allclose(train_a, train_b)


@pytest.mark.parametrize("share", [None, True, False])
def test_encoder_decoder_dropout_masks_follow_the_reference_configurable_transformer(share):
    from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

    config = tiny_config(dropout=0.1, ff_dropout=0.2, attention_dropout=0.3, share_dropout_over_length=share)
    model = EncoderDecoderModel(EncoderDecoderTransformer(config))
    inputs, targets = _padded_batch(2, 6, 5, model.config.vocab_size)
    batch = {"encoder_input_tokens": inputs, "decoder_target_tokens": targets}
    calls = dropout_calls(lambda p: model.logits(p, batch, dropout_rng=jax.random.key(1)), model.abstract_params())
    # None: ConfigurableTransformer's default dropout_shared_axes=None, one mask per position.
    shared = (-2,) if share else ()
    sites = {"EncoderDecoderTransformer", "EncoderLayer", "DecoderLayer", "FeedForward"}  # embedding, residuals
    assert {c for c in calls if c[1] == 0.1} == {(site, 0.1, shared) for site in sites}
    assert {c for c in calls if c[1] == 0.2} == {("FeedForward", 0.2, (-2,))}  # ff_dropout: always shared
    assert all(dims == () for _, rate, dims in calls if rate == 0.3)  # attention probabilities


@pytest.mark.parametrize(
    "gin_file", ["models/dense_800m.gin", "models/fully_sparse_800m.gin", "models/moe_ff_800m.gin"]
)
def test_encoder_decoder_configs_draw_dropout_masks_per_position_as_the_reference(gin_file):
    from terra.gin_config import parsing

    # sparse_c4_pretrain_16gb_adafactor.gin keeps ConfigurableTransformer's dropout_shared_axes=None.
    parsing.parse_gin([gin_file, "sizes/tiny.gin"], finalize=False)  # a model alone: no data layer (TensorFlow)
    assert parsing.build_model().config.share_dropout_over_length is False


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32_and_decodes_consistently(tiny_model):
    from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

    model32, params = tiny_model
    model16 = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config(dtype="bfloat16")))
    inputs, targets = _padded_batch(*SHARED_SHAPE, model32.config.vocab_size)
    decoder_inputs = _decoder_inputs(targets)
    full32 = _full_logits(model32, params, inputs, decoder_inputs)
    full16 = _full_logits(model16, params, inputs, decoder_inputs)  # same float32 parameters
    assert full16.dtype == jnp.float32
    np.testing.assert_allclose(full16, full32, atol=0.1)
    decoder = model16.decoder(5)
    cache = decoder.prefill(params, inputs)
    assert cache["decoder_0"]["self_attention"]["kv"].key.dtype == jnp.bfloat16
    for t in range(5):
        logits, cache = decoder.step(params, cache, decoder_inputs[:, t])
        np.testing.assert_allclose(logits, full16[:, t], atol=0.05)
