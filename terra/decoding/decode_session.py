"""One decode driven a token at a time from the host, at the cost of the generation loop's step.

``IncrementalDecoder.step(params, cache, token)`` is one jitted call per token: at the 800M
widths each call hands XLA about 1,000 parameter arrays and 200 cache arrays (flattened out of
their pytrees, checked, the caches donated and their successors wrapped again), host work of the
order of a fully sparse int8 step itself, done while the step's cores wait (docs/decode_speed.md,
"One call per token").

A ``DecodeSession`` runs the decode as one jitted ``while_loop`` instead, started once on a thread
of its own with the parameters and the cache: each iteration runs ``step_fn`` and hands the
logits to the host through an ``io_callback``, which waits for the token the caller chooses.
``session.step(token)`` passes that token in and returns the next logits, so a call costs the
loop's step and two queue hand-offs, not the arrays' handling.

    with decoder.start(params, encoder_input_tokens) as session:   # prefills, starts the loop
        token = np.zeros((batch,), np.int32)                         # the start token
        for _ in range(n):
            logits = session.step(token)                              # [batch, vocab] float32
            token = logits.argmax(-1).astype(np.int32)
    cache = session.cache                                             # once closed

The loop's program is compiled once per decoder, batch and cache structure, and shared by its
sessions. The parameters are bound when the session starts. A session that is not closed is
closed when it is garbage collected (its loop is told to stop; the thread ends).
"""

import itertools
import queue
import threading
import weakref
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


class _Channel:
    """A session's two hand-offs: tokens (or the stop) to the loop, logits (or a failure) back."""

    def __init__(self, batch: int):
        self.batch = batch
        self.to_loop: "queue.SimpleQueue" = queue.SimpleQueue()
        self.to_host: "queue.SimpleQueue" = queue.SimpleQueue()
        self.cache: Any = None  # the loop's final cache
        self.failure: Optional[BaseException] = None


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


# Session id -> channel: the loop's callbacks find their session's channel by the id it carries
# as an operand, so one compiled loop serves every session of a decoder.
_CHANNELS: Dict[int, _Channel] = {}
_IDS = itertools.count()


def _next_token(session_id):
    channel = _CHANNELS[int(session_id)]
    token, stop = channel.to_loop.get()
    if stop:
        return np.zeros((channel.batch,), np.int32), np.bool_(True)
    return token, np.bool_(False)


def _hand_over(session_id, logits):
    # The callback's operand may be a view of a buffer XLA reuses after it returns: copy it.
    _CHANNELS[int(session_id)].to_host.put(np.array(logits, copy=True))
    return _next_token(session_id)


def session_loop(decoder, batch: int):
    """The loop a session runs, ``(params, cache, session_id) -> cache``: up to the decoder's
    ``max_decode_length`` steps, each token taken from the host and each step's logits handed to
    it, until the host says stop."""
    spec = (jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))

    def loop(params, cache, session_id):
        token, stop = io_callback(_next_token, spec, session_id)

        def keep_going(carry):
            i, _, _, stop = carry
            return (i < decoder.max_decode_length) & ~stop

        def one_token(carry):
            i, cache, token, _ = carry
            logits, cache = decoder.step_fn(params, cache, token)
            token, stop = io_callback(_hand_over, spec, session_id, logits)
            return i + 1, cache, token, stop

        _, cache, _, _ = jax.lax.while_loop(keep_going, one_token, (jnp.int32(0), cache, token, stop))
        return cache

    return jax.jit(loop, donate_argnums=(1,))


def _run(loop, params, cache, session_id, channel: _Channel):
    try:
        channel.cache = jax.block_until_ready(loop(params, cache, np.int32(session_id)))
    except BaseException as error:  # handed to the caller's step or close
        channel.failure = error
        channel.to_host.put(_Failure(error))
    finally:
        _CHANNELS.pop(session_id, None)


def _stop(channel: _Channel):
    channel.to_loop.put((None, True))


class DecodeSession:
    """The per-token decode of one batch: ``step(token) -> logits``, the cache held by its loop.

    Args:
      decoder: the ``IncrementalDecoder`` whose ``step_fn`` the loop runs.
      params: the model's parameters (bound for the session's life).
      cache: a cache ``decoder.prefill`` returned, donated to the session (do not use it after).
    """

    def __init__(self, decoder, params, cache: Any):
        leaves = jax.tree.leaves(cache)
        batched = [leaf for leaf in leaves if getattr(leaf, "ndim", 0)]
        if not batched:
            raise ValueError("DecodeSession needs the cache decoder.prefill returned; this one holds no arrays.")
        # Every cache array of a layer is [batch, ...] (the positions' index is a scalar).
        self.batch = int(batched[0].shape[0])
        self.max_steps = decoder.max_decode_length
        self.steps = 0
        self._closed = False
        self._session_id = next(_IDS)
        self._channel = _Channel(self.batch)
        _CHANNELS[self._session_id] = self._channel
        loop = decoder.session_loop(self.batch)
        # The thread holds the channel, not the session: an abandoned session is collected, and
        # its finalizer stops the loop.
        self._thread = threading.Thread(
            target=_run, args=(loop, params, cache, self._session_id, self._channel), daemon=True
        )
        self._finalizer = weakref.finalize(self, _stop, self._channel)
        self._thread.start()

    def step(self, token) -> np.ndarray:
        """``token`` ``[batch]`` integers (the previous token; the start token 0 first) -> the
        next position's ``[batch, vocab]`` float32 logits, as a NumPy array. Raises
        ``ValueError`` for a token of another shape, past the decoder's ``max_decode_length``
        steps or once closed, before anything runs; re-raises the loop's error if it failed."""
        if self._closed:
            raise ValueError("this session is closed; start a new one.")
        if self.steps >= self.max_steps:
            raise ValueError(
                f"this session has run its {self.max_steps} steps (the decoder's max_decode_length); "
                "close it and start a new one, or build the decoder with a longer max_decode_length."
            )
        token = np.asarray(token)
        if token.shape != (self.batch,) or not np.issubdtype(token.dtype, np.integer):
            raise ValueError(
                f"token has shape {token.shape} and dtype {token.dtype}; a step takes one integer "
                f"token per row, shape ({self.batch},)."
            )
        self._channel.to_loop.put((token.astype(np.int32), False))
        out = self._channel.to_host.get()
        if isinstance(out, _Failure):
            self._closed = True
            raise out.error
        self.steps += 1
        return out

    def close(self) -> Any:
        """Stops the loop and returns its cache (as ``decoder.step`` returns it), also kept as
        ``cache``. Closing twice returns the same cache."""
        if not self._closed:
            self._closed = True
            self._finalizer()  # sends the stop, once
        self._thread.join()
        if self._channel.failure is not None:
            raise self._channel.failure
        return self._channel.cache

    @property
    def cache(self) -> Any:
        """The cache after the session's steps; the session must be closed."""
        if not self._closed:
            raise ValueError("the cache is held by the running loop: close the session first.")
        return self.close()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()
        self._thread.join()
