"""Generation through the decode contract: greedy, temperature and top-k / top-p sampling, EOS
handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.decoding import generate, sample_next_token
from terra.decoding.decode_step import IncrementalDecoder
from terra.models import shift_right

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def test_temperature_zero_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (5, 13))
    for seed in range(3):
        np.testing.assert_array_equal(sample_next_token(logits, jax.random.key(seed), 0.0), jnp.argmax(logits, -1))


def test_temperature_sampling_follows_the_tempered_softmax():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    temperature = 0.5
    draws = jax.jit(jax.vmap(lambda k: sample_next_token(logits[None], k, temperature)[0]))(
        jax.random.split(jax.random.key(0), 20000)
    )
    freq = np.bincount(np.asarray(draws), minlength=3) / draws.shape[0]
    expected = jax.nn.softmax(logits / temperature)
    np.testing.assert_allclose(freq, expected, atol=0.015)


# The tests of the tiny model decode [2, 8] inputs with the model's decoder for 10 tokens: one
# prefill and one generation loop (its scalars are traced) serve them all.
DECODE_LENGTH = 10


def _tiny_inputs(model, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(2, model.config.vocab_size, size=(2, 8)), jnp.int32)


def test_greedy_generation_is_the_argmax_of_the_full_forward_pass(tiny_model):
    model, params = tiny_model
    inputs = _tiny_inputs(model, 0)
    out = model.generate(params, inputs, max_decode_length=DECODE_LENGTH)
    assert out.tokens.shape[0] == 2
    # Teacher-force the generated tokens: each one must be the argmax at its position. Both rows in
    # one pass: the decoder is causal, so the pad tokens after a row's EOS change none of its logits.
    logits = jax.jit(lambda p, i, d: model.module.apply({"params": p}, i, d))(params, inputs, shift_right(out.tokens))
    for row in range(2):
        n = int(out.lengths[row])
        np.testing.assert_array_equal(jnp.argmax(logits[row, :n], -1), out.tokens[row, :n])


def test_sampling_is_reproducible_from_its_seed(tiny_model):
    model, params = tiny_model
    inputs = _tiny_inputs(model, 1)
    a = model.generate(params, inputs, max_decode_length=DECODE_LENGTH, temperature=5.0, seed=7)
    b = model.generate(params, inputs, max_decode_length=DECODE_LENGTH, temperature=5.0, seed=7)
    c = model.generate(params, inputs, max_decode_length=DECODE_LENGTH, temperature=5.0, seed=8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


class _ScriptedDecoder(IncrementalDecoder):
    """An IncrementalDecoder whose step is scripted: row r emits EOS (id 1) at step eos_at[r],
    else 5; the cache counts the steps taken."""

    def __init__(self, eos_at, vocab=8, max_decode_length=10):
        super().__init__(module=None, max_decode_length=max_decode_length)
        self.eos_at = jnp.asarray(eos_at)
        self.vocab = vocab

    def prefill_fn(self, params, inputs, mask=None):
        return jnp.zeros((), jnp.int32)

    def step_fn(self, params, cache, token):
        target = jnp.where(self.eos_at == cache, 1, 5)
        return jax.nn.one_hot(target, self.vocab) * 10.0, cache + 1


def test_each_row_stops_at_its_own_eos_and_the_loop_ends_when_all_have():
    decoder = _ScriptedDecoder(eos_at=[1, 3, 2])
    out = generate(decoder, None, jnp.ones((3, 4), jnp.int32), eos_id=1, pad_id=0)
    np.testing.assert_array_equal(out.lengths, [2, 4, 3])
    np.testing.assert_array_equal(out.tokens, [[5, 1, 0, 0], [5, 5, 5, 1], [5, 5, 1, 0]])
    # The loop stopped after the last row's EOS: 4 steps of the 10 the cache allows.
    _, steps, cache = decoder.generate_tokens(
        None, decoder.prefill(None, None), jnp.zeros((3,), jnp.int32), jax.random.key(0), 10, 0.0, 1, 0
    )
    assert int(steps) == 4 and int(cache) == 4


def test_generation_without_eos_runs_to_max_new_tokens():
    decoder = _ScriptedDecoder(eos_at=[99])
    out = generate(decoder, None, jnp.ones((1, 4), jnp.int32), max_new_tokens=6)
    assert out.tokens.shape == (1, 6) and out.lengths.tolist() == [6]


def test_asking_for_more_tokens_than_the_cache_holds_is_an_error():
    with pytest.raises(ValueError, match="max_decode_length"):
        generate(
            _ScriptedDecoder(eos_at=[99], max_decode_length=4), None, jnp.ones((1, 2), jnp.int32), max_new_tokens=5
        )
    with pytest.raises(ValueError, match="temperature"):
        generate(_ScriptedDecoder(eos_at=[99]), None, jnp.ones((1, 2), jnp.int32), temperature=-1.0)


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_top_k_and_top_p_out_of_range_are_errors(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        generate(_ScriptedDecoder(eos_at=[99]), None, jnp.ones((1, 2), jnp.int32), temperature=1.0, **kwargs)


class _FixedDistributionDecoder(IncrementalDecoder):
    """An IncrementalDecoder whose every step has the same next-token distribution."""

    def __init__(self, probs, max_decode_length=8):
        super().__init__(module=None, max_decode_length=max_decode_length)
        self.log_probs = jnp.log(jnp.asarray(probs, jnp.float32))

    def prefill_fn(self, params, inputs, mask=None):
        return jnp.zeros((), jnp.int32)

    def step_fn(self, params, cache, token):
        return jnp.broadcast_to(self.log_probs, (token.shape[0], self.log_probs.shape[0])), cache + 1


def test_generation_samples_only_from_the_top_k_or_the_nucleus():
    # Token 1 (EOS) is outside every filter below, so all rows run to max_new_tokens.
    decoder = _FixedDistributionDecoder([0.3, 0.05, 0.25, 0.2, 0.1, 0.1])
    inputs = jnp.ones((64, 2), jnp.int32)
    for kwargs, allowed in [(dict(top_k=2), {0, 2}), (dict(top_p=0.7), {0, 2, 3}), (dict(top_k=3, top_p=0.5), {0, 2})]:
        out = generate(decoder, None, inputs, temperature=1.0, seed=3, **kwargs)
        assert out.tokens.shape == (64, 8)
        assert set(np.unique(out.tokens)) == allowed, kwargs


@pytest.mark.slow
def test_generation_loop_matches_a_python_loop_over_step(tiny_model):
    model, params = tiny_model
    decoder = model.decoder(DECODE_LENGTH)  # 7 of its 10 slots used
    inputs = _tiny_inputs(model, 2)
    for temperature in (0.0, 3.0):
        rng = jax.random.key(11)
        cache = decoder.prefill(params, inputs)
        token = jnp.zeros((2,), jnp.int32)
        expected = []
        for _ in range(7):  # no EOS stop here: eos_id -1 never matches
            logits, cache = decoder.step(params, cache, token)
            rng, sample_rng = jax.random.split(rng)
            token = sample_next_token(logits, sample_rng, temperature)
            expected.append(token)
        tokens, steps, _ = decoder.generate_tokens(
            params,
            decoder.prefill(params, inputs),
            jnp.zeros((2,), jnp.int32),
            jax.random.key(11),
            7,
            temperature,
            -1,
            0,
        )
        assert int(steps) == 7
        np.testing.assert_array_equal(tokens[:, :7], jnp.stack(expected, axis=1))
        assert not np.any(tokens[:, 7:])  # the slots beyond the 7 steps hold the pad id


def test_generation_compiles_once_whatever_types_its_scalars_come_in():
    decoder = _ScriptedDecoder(eos_at=[99])
    start = jnp.zeros((1,), jnp.int32)
    decoder.generate_tokens(None, decoder.prefill(None, None), start, jax.random.key(0), 3, 0, 1, 0)
    decoder.generate_tokens(
        None, decoder.prefill(None, None), start, jax.random.key(0), jnp.int32(5), 0.5, jnp.int32(1), 0
    )
    generate(decoder, None, jnp.ones((1, 2), jnp.int32), max_new_tokens=4, temperature=1.0)
    generate(decoder, None, jnp.ones((1, 2), jnp.int32), max_new_tokens=4, temperature=1.0, top_k=3, top_p=0.9)
    decoder.generate_tokens(
        None, decoder.prefill(None, None), start, jax.random.key(0), 2, 1.0, 1, 0, jnp.int32(2), 0.5
    )
    assert decoder._generate_tokens_jit._cache_size() == 1
