"""DecodeSession: one call per token through a jitted loop that takes each token from the host."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.decoding import DecodeSession
from terra.decoding.decode_step import IncrementalDecoder

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

STEPS = 6


@pytest.fixture(scope="module")
def decoder_and_inputs(tiny_model):
    model, params = tiny_model
    inputs = jnp.asarray(np.random.default_rng(3).integers(2, model.config.vocab_size, size=(2, 7)), jnp.int32)
    return model.decoder(STEPS), params, inputs


def test_session_steps_equal_the_decoders_step_calls(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    cache = decoder.prefill(params, inputs)
    token = jnp.zeros((2,), jnp.int32)
    expected = []
    for _ in range(STEPS):
        logits, cache = decoder.step(params, cache, token)
        expected.append(np.asarray(logits))
        token = jnp.argmax(logits, -1).astype(jnp.int32)

    with decoder.start(params, inputs) as session:
        assert isinstance(session, DecodeSession) and session.batch == 2
        token = np.zeros((2,), np.int32)
        for want in expected:
            logits = session.step(token)
            assert isinstance(logits, np.ndarray) and logits.shape == want.shape and logits.dtype == np.float32
            np.testing.assert_allclose(logits, want, atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(logits.argmax(-1), want.argmax(-1))
            token = logits.argmax(-1)  # int64 from NumPy: any integer dtype is taken
    # The loop's cache, once closed, is the cache the step calls left.
    for got, want in zip(jax.tree.leaves(session.cache), jax.tree.leaves(cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_sessions_run_side_by_side_on_one_compiled_loop(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    first, second = decoder.start(params, inputs), decoder.start(params, inputs[::-1])
    token = np.zeros((2,), np.int32)
    for _ in range(3):
        a, b = first.step(token), second.step(token)
        # Other XLA work runs while both loops wait for their next tokens.
        assert int(jnp.sum(jnp.asarray(a).argmax(-1) * 0)) == 0
        np.testing.assert_array_equal(a[::-1].argmax(-1), b.argmax(-1))  # the rows, swapped
        token = a.argmax(-1)
    first.close(), second.close()
    assert decoder.session_loop(2)._cache_size() == 1


def test_session_refuses_bad_tokens_extra_steps_and_steps_after_close(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    session = decoder.start(params, inputs)
    for bad in (np.zeros((3,), np.int32), np.zeros((2, 1), np.int32), np.zeros((2,), np.float32)):
        with pytest.raises(ValueError, match=r"one integer token per row, shape \(2,\)"):
            session.step(bad)
    with pytest.raises(ValueError, match="close the session first"):
        _ = session.cache
    for _ in range(STEPS):
        session.step(np.zeros((2,), np.int32))
    with pytest.raises(ValueError, match=f"run its {STEPS} steps"):
        session.step(np.zeros((2,), np.int32))
    cache = session.close()
    assert session.close() is cache and session.cache is cache  # closing twice is harmless
    assert int(cache["decoder_0"]["self_attention"]["kv"].index) == STEPS
    with pytest.raises(ValueError, match="closed"):
        session.step(np.zeros((2,), np.int32))


def test_an_abandoned_session_stops_its_loop(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    session = decoder.start(params, inputs)
    session.step(np.zeros((2,), np.int32))
    thread = session._thread
    del session
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive()


class _FailingDecoder(IncrementalDecoder):
    """A decoder whose step cannot be traced: its error must reach the session's caller."""

    def __init__(self):
        super().__init__(module=None, max_decode_length=4)

    def step_fn(self, params, cache, token):
        raise ValueError("this step cannot be traced")


def test_a_loop_that_fails_raises_its_error_at_the_callers_step():
    session = DecodeSession(_FailingDecoder(), None, {"keys": jnp.zeros((1, 3))})
    with pytest.raises(ValueError, match="cannot be traced"):
        session.step(np.zeros((1,), np.int32))
    with pytest.raises(ValueError, match="closed"):
        session.step(np.zeros((1,), np.int32))
    with pytest.raises(ValueError, match="cannot be traced"):
        session.close()
