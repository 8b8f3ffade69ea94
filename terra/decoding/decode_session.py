"""One decode driven a token at a time from the host, at the cost of the generation loop's step.

``IncrementalDecoder.step(params, cache, token)`` is one jitted call per token: at the 800M
widths each call hands XLA about 1,000 parameter arrays and 200 cache arrays (flattened out of
their pytrees, checked, the caches donated and their successors wrapped again), host work of the
order of a fully sparse int8 step itself, done while the step's cores wait (docs/decode_speed.md,
"One call per token").

A ``DecodeSession`` runs the decode as one jitted ``while_loop`` instead, started once on a thread
of its own with the parameters and the cache: each iteration runs ``step_fn`` and hands the
logits to the host, then waits for the token the caller chooses. ``session.step(token)`` passes
that token in and returns the next logits, so a call costs the loop's step and two hand-offs,
not the arrays' handling. With terra's native kernels the hand-off is theirs
(``terra/backends/native/session_exchange.cc``: a custom call that waits on a condition
variable, the host's side called through ctypes); without them it is an ``io_callback`` and two
queues, which cost more per token (jax wraps the logits as a CPU array and converts the token
back, in Python on XLA's thread).

    with decoder.start(params, encoder_input_tokens) as session:   # prefills, starts the loop
        token = np.zeros((batch,), np.int32)                         # the start token
        for _ in range(n):
            logits = session.step(token)                              # [batch, vocab] float32
            token = logits.argmax(-1).astype(np.int32)
    cache = session.cache                                             # once closed

The loop's program is compiled once per decoder, batch and cache structure, and shared by its
sessions. The parameters are bound when the session starts. One session runs at a time per
process: its waiting loop holds one of the threads XLA:CPU runs programs on, and two waiting loops
can hold them all. A session that is not closed is closed when it is garbage collected (its loop
is told to stop; the thread ends).
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

from terra.backends import native_kernels


class _QueueExchange:
    """The hand-off through ``io_callback`` and two queues (without the native kernels): tokens (or
    the stop) to the loop, logits back (``None`` once the loop has ended)."""

    def __init__(self, session_id: int, batch: int):
        self.session_id, self.batch = session_id, batch
        self.to_loop: "queue.SimpleQueue" = queue.SimpleQueue()
        self.to_host: "queue.SimpleQueue" = queue.SimpleQueue()
        _QUEUES[session_id] = self

    def step(self, token: np.ndarray):
        self.to_loop.put((token, False))
        return self.to_host.get()

    def stop(self) -> None:
        self.to_loop.put((None, True))

    def end(self) -> None:
        _QUEUES.pop(self.session_id, None)
        self.to_host.put(None)  # wakes a step waiting for logits the loop will not send


# Session id -> its queues: the loop's callbacks find them by the id it carries as an operand, so
# one compiled loop serves every session of a decoder.
_QUEUES: Dict[int, _QueueExchange] = {}


def _queued_token(session_id):
    exchange = _QUEUES[int(session_id)]
    token, stop = exchange.to_loop.get()
    if stop:
        return np.zeros((exchange.batch,), np.int32), np.bool_(True)
    return token, np.bool_(False)


def _queued_hand_over(session_id, logits):
    # The callback's operand may be a view of a buffer XLA reuses after it returns: copy it.
    _QUEUES[int(session_id)].to_host.put(np.array(logits, copy=True))
    return _queued_token(session_id)


class _NativeExchange:
    """The hand-off through the native kernels' session exchange (session_exchange.cc)."""

    def __init__(self, library, session_id: int, batch: int, vocab: int):
        self.library, self.session_id, self.shape = library, session_id, (batch, vocab)
        if library.terra_session_open(session_id, batch, vocab):
            raise RuntimeError(f"decode session {session_id} is open already")

    def step(self, token: np.ndarray):
        logits = np.empty(self.shape, np.float32)
        if self.library.terra_session_step(self.session_id, token.ctypes.data, logits.ctypes.data):
            return None  # the loop has ended
        return logits

    def stop(self) -> None:
        self.library.terra_session_stop(self.session_id)

    def end(self) -> None:
        self.library.terra_session_end(self.session_id)


def session_loop(decoder, batch: int, native: bool):
    """The loop a session runs, ``(params, cache, session_id) -> cache``: up to the decoder's
    ``max_decode_length`` steps, each token taken from the host and each step's logits handed to
    it (through the native exchange, or ``io_callback``), until the host says stop."""
    spec = (jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))
    if native:
        first_token = jax.ffi.ffi_call("terra_session_first_token", spec, has_side_effect=True)
        hand_over = jax.ffi.ffi_call("terra_session_hand_over", spec, has_side_effect=True)
    else:

        def first_token(session_id):
            return io_callback(_queued_token, spec, session_id)

        def hand_over(session_id, logits):
            return io_callback(_queued_hand_over, spec, session_id, logits)

    def loop(params, cache, session_id):
        token, stop = first_token(session_id)

        def keep_going(carry):
            i, _, _, stop = carry
            return (i < decoder.max_decode_length) & ~stop

        def one_token(carry):
            i, cache, token, _ = carry
            logits, cache = decoder.step_fn(params, cache, token)
            token, stop = hand_over(session_id, logits.astype(jnp.float32))
            return i + 1, cache, token, stop

        _, cache, _, _ = jax.lax.while_loop(keep_going, one_token, (jnp.int32(0), cache, token, stop))
        return cache

    return jax.jit(loop, donate_argnums=(1,))


class _Runner:
    """What the loop's thread holds (not the session: an abandoned session is collected, and its
    finalizer stops the loop): the exchange, and the loop's cache or failure once it returns."""

    def __init__(self, exchange):
        self.exchange = exchange
        self.cache: Any = None
        self.failure: Optional[BaseException] = None
        self.stopping = False

    def run(self, loop, params, cache, session_id: int) -> None:
        try:
            self.cache = jax.block_until_ready(loop(params, cache, np.int32(session_id)))
        except BaseException as error:  # handed to the caller's step or close
            self.failure = error
        finally:
            self.exchange.end()

    def stop(self) -> None:
        self.stopping = True
        self.exchange.stop()


_IDS = itertools.count()
# The running session's runner and thread. One at a time per process: a waiting loop holds one of
# the threads XLA:CPU runs programs on, and two waiting loops can hold all of them, after which no
# other program starts (nor the next session's step): a deadlock (docs/decode_speed.md).
_RUNNING: Dict[str, Any] = {"runner": None, "thread": None}
_START = threading.Lock()


def _claim_the_process() -> None:
    """Returns once no other session's loop runs (waiting for one told to stop); raises
    ``ValueError`` while one is open."""
    runner, thread = _RUNNING["runner"], _RUNNING["thread"]
    if thread is None or not thread.is_alive():
        return
    if not runner.stopping:
        raise ValueError(
            "another DecodeSession is open in this process, and one runs at a time (its loop holds "
            "one of XLA's threads): close it first, or decode the sequences as one batch."
        )
    thread.join()


class DecodeSession:
    """The per-token decode of one batch: ``step(token) -> logits``, the cache held by its loop.

    Args:
      decoder: the ``IncrementalDecoder`` whose ``step_fn`` the loop runs.
      params: the model's parameters (bound for the session's life).
      cache: a cache ``decoder.prefill`` returned, donated to the session (do not use it after).

    One session runs at a time per process (a ``ValueError`` names the open one): decode several
    sequences as one batch. Raises the step's error at once where it cannot be traced for this
    cache.
    """

    def __init__(self, decoder, params, cache: Any):
        leaves = jax.tree.leaves(cache)
        batched = [leaf for leaf in leaves if getattr(leaf, "ndim", 0)]
        if not batched:
            raise ValueError("DecodeSession needs the cache decoder.prefill returned; this one holds no arrays.")
        # Every cache array of a layer is [batch, ...] (the positions' index is a scalar).
        self.batch = int(batched[0].shape[0])
        # The native hand-off is a CPU custom call: a decode on an accelerator hands over through
        # io_callback.
        self._on_cpu = all(device.platform == "cpu" for device in getattr(batched[0], "devices", set)())
        self.vocab = decoder.logits_width(params, cache, self.batch)
        self.max_steps = decoder.max_decode_length
        self.steps = 0
        self._closed = False
        self._calling = threading.Lock()  # one step at a time: the exchange holds one token
        with _START:
            _claim_the_process()
            self._start(decoder, params, cache)

    def _start(self, decoder, params, cache) -> None:
        session_id = next(_IDS) % (1 << 31)
        library = native_kernels.session_library() if self._on_cpu else None
        if library is not None:
            exchange = _NativeExchange(library, session_id, self.batch, self.vocab)
        else:
            exchange = _QueueExchange(session_id, self.batch)
        self._runner = _Runner(exchange)
        loop = decoder.session_loop(self.batch, native=library is not None)
        self._thread = threading.Thread(target=self._runner.run, args=(loop, params, cache, session_id), daemon=True)
        self._finalizer = weakref.finalize(self, self._runner.stop)
        self._thread.start()
        _RUNNING.update(runner=self._runner, thread=self._thread)

    def step(self, token) -> np.ndarray:
        """``token`` ``[batch]`` integers (the previous token; the start token 0 first) -> the
        next position's ``[batch, vocab]`` float32 logits, as a NumPy array. Raises
        ``ValueError`` for a token of another shape or outside ``[0, vocab)``, past the decoder's
        ``max_decode_length`` steps or once closed, before anything runs; re-raises the loop's
        error if it failed. Calls from several threads run one after the other."""
        with self._calling:
            return self._step(token)

    def _step(self, token) -> np.ndarray:
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
        if token.min() < 0 or token.max() >= self.vocab:
            raise ValueError(
                f"token ids must lie in the vocabulary [0, {self.vocab}); "
                f"this token holds {token.min()} to {token.max()}."
            )
        out = self._runner.exchange.step(np.ascontiguousarray(token, np.int32))
        if out is None:
            self._closed = True
            self._thread.join()
            raise self._runner.failure or RuntimeError("the session's loop ended without an error")
        self.steps += 1
        return out

    def close(self) -> Any:
        """Stops the loop and returns its cache (as ``decoder.step`` returns it), also kept as
        ``cache``. Closing twice returns the same cache; a failed loop's error is raised."""
        self._stop_and_wait()
        if self._runner.failure is not None:
            raise self._runner.failure
        return self._runner.cache

    @property
    def cache(self) -> Any:
        """The cache after the session's steps; the session must be closed."""
        if not self._closed:
            raise ValueError("the cache is held by the running loop: close the session first.")
        return self.close()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc) -> None:
        self._stop_and_wait()  # the loop's error, if any, is close()'s to raise

    def _stop_and_wait(self) -> None:
        self._closed = True
        self._finalizer()  # sends the stop, once
        self._thread.join()
