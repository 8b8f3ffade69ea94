"""DecodeSession: one call per token through a jitted loop that takes each token from the host."""

import contextlib
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from terra.backends import native_kernels
from terra.decoding import DecodeSession, decode_session
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


@pytest.mark.parametrize("native", [True, False], ids=["native exchange", "io_callback"])
def test_other_work_runs_while_a_session_waits_and_a_second_is_refused_until_it_closes(decoder_and_inputs, native):
    decoder, params, inputs = decoder_and_inputs
    # Where the library was not built (an install without a C++ compiler) the session must fall
    # back to the io_callback hand-off: the "native" case then checks that fallback.
    native = native and native_kernels.available()
    token = np.zeros((2,), np.int32)
    with contextlib.nullcontext() if native else native_kernels.disabled():
        session = decoder.start(params, inputs)
        expected = decode_session._NativeExchange if native else decode_session._QueueExchange
        assert isinstance(session._runner.exchange, expected)
        first = session.step(token)
        # Other XLA programs run while the loop waits for its next token.
        assert int(jnp.argmax(jnp.asarray(first), -1).shape[0]) == 2
        with pytest.raises(ValueError, match="another DecodeSession is open"):
            decoder.start(params, inputs)
        session.close()
        with decoder.start(params, inputs) as again:
            np.testing.assert_allclose(again.step(token), first, atol=1e-6)
    assert decoder.session_loop(2, native)._cache_size() == 1


def test_session_refuses_bad_tokens_extra_steps_and_steps_after_close(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    session = decoder.start(params, inputs)
    for bad in (np.zeros((3,), np.int32), np.zeros((2, 1), np.int32), np.zeros((2,), np.float32)):
        with pytest.raises(ValueError, match=r"one integer token per row, shape \(2,\)"):
            session.step(bad)
    for ids in ([0, -1], [0, session.vocab], [2**40, 0]):  # 2**40 would wrap to 0 as int32
        with pytest.raises(ValueError, match=rf"in the vocabulary \[0, {session.vocab}\)"):
            session.step(np.asarray(ids, np.int64))
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


def test_steps_from_two_threads_run_one_after_the_other(decoder_and_inputs):
    decoder, params, inputs = decoder_and_inputs
    with decoder.start(params, inputs) as session:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(session.step(np.zeros((2,), np.int32)))) for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert session.steps == 3 and len(results) == 3
        assert all(r.shape == (2, session.vocab) for r in results)
    assert int(session.cache["decoder_0"]["self_attention"]["kv"].index) == 3


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
    """A decoder whose step cannot be traced."""

    def __init__(self):
        super().__init__(module=None, max_decode_length=4)

    def step_fn(self, params, cache, token):
        raise ValueError("this step cannot be traced")


def test_a_step_that_cannot_be_traced_fails_the_start_before_a_loop_runs():
    with pytest.raises(ValueError, match="cannot be traced"):
        DecodeSession(_FailingDecoder(), None, {"keys": jnp.zeros((1, 3))})
