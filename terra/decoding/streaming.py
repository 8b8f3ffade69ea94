"""Tokens handed to the host as the generation loop decodes them, and text printed as words.

``IncrementalDecoder.generate_tokens(..., stream_id=...)`` runs the same jitted ``while_loop`` as
generation without a stream, plus one hand-over per step of the step's chosen tokens (``[batch]``
int32) to the host, which answers whether to stop. Each token is chosen in the loop exactly as
without a stream, so the tokens streamed are the tokens generation returns; the stream's id is an
operand of the loop, so one compiled loop serves every stream of a decoder.

On the CPU with terra's native kernels the hand-over is theirs (``token_stream.cc``): the loop's
custom call queues the step's tokens and returns at once (the host's stop request, if any, ends
the loop at a later step), and a reader thread takes them in order through ctypes and calls the
receiver, so the loop never waits for Python. Elsewhere it is an ``io_callback`` that calls the
receiver on XLA's thread between steps.

A receiver is any ``(step, tokens) -> bool`` callable (:func:`open_stream`); returning True asks
the loop to end (every row is then treated as done). :class:`BatchStream` is the one
``InteractiveModel.generate`` uses: it follows each row to its EOS and turns its tokens into text
through :class:`RowText`, which holds back a word until it is whole (SentencePiece splits words
into pieces; a piece alone may be half a word or half a UTF-8 character), as Hugging Face's
``TextStreamer`` does.
"""

import ctypes
import itertools
import threading
import unicodedata
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from terra.backends import native_kernels

# (step, tokens [batch] int32) -> stop
Receiver = Callable[[int, np.ndarray], bool]

# Stream id -> its receiver, for the io_callback hand-over.
_RECEIVERS: Dict[int, Receiver] = {}
_IDS = itertools.count(1)


class Stream:
    """An open stream: ``operand`` is the id its loop carries; ``close()`` once the loop has
    returned (or failed) hands over what is left and forgets the stream. Opened both ways: the
    receiver registered for the ``io_callback`` hand-over and, where the native library is
    loaded, its queue and reader thread (a loop traced with the kernels switched off calls back)."""

    def __init__(self, receiver: Receiver, batch: int):
        self.id, self.receiver, self.batch = next(_IDS), receiver, batch
        self.operand = jnp.int32(self.id)
        self.error: Optional[BaseException] = None
        _RECEIVERS[self.id] = receiver
        self.library, self.reader = native_kernels.stream_library(), None
        if self.library is not None:
            if self.library.terra_stream_open(self.id, batch):
                raise RuntimeError(f"token stream {self.id} is open already")
            self.reader = threading.Thread(target=self._read, name="terra-stream-reader", daemon=True)
            self.reader.start()

    def _read(self) -> None:
        step, tokens = ctypes.c_int32(), np.empty((self.batch,), np.int32)
        while self.library.terra_stream_next(self.id, ctypes.byref(step), tokens.ctypes.data) == 0:
            if self.error is not None:
                continue  # drained: the loop was told to stop
            try:
                stop = self.receiver(step.value, tokens.copy())
            except BaseException as error:  # raised by close(), on the caller's thread
                self.error, stop = error, True
            if stop:
                self.library.terra_stream_stop(self.id)

    def close(self) -> None:
        _RECEIVERS.pop(self.id, None)
        if self.reader is not None:
            self.library.terra_stream_end(self.id)
            self.reader.join()
            self.library.terra_stream_close(self.id)
        if self.error is not None:
            raise self.error


def open_stream(receiver: Receiver, batch: int) -> Stream:
    """Opens a stream of ``batch`` rows handing each step to ``receiver``; pass its ``operand``
    as the loop's ``stream_id`` and ``close()`` it after the loop."""
    return Stream(receiver, batch)


def _deliver(stream_id, step, tokens):
    receiver = _RECEIVERS.get(int(stream_id))
    stop = True if receiver is None else bool(receiver(int(step), np.array(tokens, np.int32)))
    return np.bool_(stop)


def hand_over(stream_id: jax.Array, step: jax.Array, tokens: jax.Array) -> jax.Array:
    """Inside a traced loop: hands ``tokens`` of ``step`` to the stream; a scalar bool, True once
    the receiver has asked the loop to stop (or the stream is closed). The native queue where the
    kernels are available on the CPU (chosen when traced), else an ``io_callback``."""
    stop = jax.ShapeDtypeStruct((), jnp.bool_)
    if jax.default_backend() == "cpu" and native_kernels.session_library() is not None:
        push = jax.ffi.ffi_call("terra_stream_push", stop, has_side_effect=True)
        return push(stream_id, step.astype(jnp.int32), tokens.astype(jnp.int32))
    return io_callback(_deliver, stop, stream_id, step, tokens)


def stop_end(text: str, stop_strings: Sequence[str]) -> Optional[int]:
    """Where ``text`` ends if cut after the first of ``stop_strings`` it holds (the one that ends
    first), or None when it holds none."""
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return min(ends) if ends else None


def _is_cjk(char: str) -> bool:
    # CJK ideographs are words of their own: printed as they come, as Hugging Face's streamer does.
    return "CJK" in unicodedata.name(char, "")


class RowText:
    """One row's text as its tokens arrive: ``add(token)`` returns the text that became printable
    (whole words: up to the last space or line end; CJK characters as they come), ``finish()`` the
    rest. The pieces joined are the vocabulary's decoding of all the tokens."""

    def __init__(self, vocabulary: Any):
        self.vocabulary = vocabulary
        self.ids: List[int] = []
        self.printed = 0

    def _new_text(self, final: bool) -> str:
        text = self.vocabulary.decode(self.ids)
        if final:
            end = len(text)
        elif text.endswith("\ufffd"):  # a UTF-8 character not yet complete (byte pieces)
            return ""
        elif text.endswith("\n") or (text and _is_cjk(text[-1])):
            end = len(text)
        else:
            end = text.rfind(" ") + 1
        if end <= self.printed:
            return ""
        piece, self.printed = text[self.printed : end], end
        return piece

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        return self._new_text(final=False)

    def finish(self) -> str:
        return self._new_text(final=True) if self.ids else ""


class BatchStream:
    """The receiver of one batch's loop: row ``r`` of the batch is output ``first_row + r`` (the
    batch's first ``rows`` rows are real; the others pad a last batch). Each row's tokens up to its
    EOS (not included) go to ``on_piece(output_row, piece)``: text pieces through :class:`RowText`
    when ``vocabulary`` is given, else each token id as an int. With ``stop_strings`` (text rows),
    a row also ends once its text contains one of them: its last piece ends with it, and the loop
    is asked to stop once every row has ended. An exception ``on_piece`` raises ends the loop
    after its step; ``finish()`` (after the loop) flushes each row's held-back text and raises
    that exception."""

    def __init__(
        self,
        on_piece: Callable[[int, Any], Any],
        *,
        rows: int,
        eos_id: int,
        first_row: int = 0,
        vocabulary: Any = None,
        stop_strings: Sequence[str] = (),
    ):
        self.on_piece, self.rows, self.eos_id, self.first_row = on_piece, rows, eos_id, first_row
        self.stop_strings = list(stop_strings) if vocabulary is not None else []
        self.texts = [RowText(vocabulary) for _ in range(rows)] if vocabulary is not None else None
        self.done = np.zeros((rows,), bool)
        self.error: Optional[BaseException] = None

    def __call__(self, step: int, tokens: np.ndarray) -> bool:
        if self.error is not None:
            return True
        try:
            for r in range(self.rows):
                if self.done[r]:
                    continue
                token = int(tokens[r])
                if token == self.eos_id:
                    self._end_row(r)
                elif self.texts is None:
                    self.on_piece(self.first_row + r, token)
                else:
                    piece = self.texts[r].add(token)
                    if piece:
                        self.on_piece(self.first_row + r, piece)
                    if self.stop_strings:
                        self._stop_at_string(r)
        except BaseException as error:  # raised by finish(), on the caller's thread
            self.error = error
        return self.error is not None or (bool(self.stop_strings) and bool(self.done.all()))

    def _stop_at_string(self, r: int) -> None:
        """Ends row ``r`` once its text holds a stop string: the rest of its text up to the end
        of the first one is its last piece."""
        row = self.texts[r]
        text = row.vocabulary.decode(row.ids)
        end = stop_end(text, self.stop_strings)
        if end is None:
            return
        if end > row.printed:
            self.on_piece(self.first_row + r, text[row.printed : end])
        row.printed = len(text)
        self.done[r] = True

    def _end_row(self, r: int) -> None:
        self.done[r] = True
        if self.texts is not None:
            piece = self.texts[r].finish()
            if piece:
                self.on_piece(self.first_row + r, piece)

    def finish(self) -> None:
        if self.error is None:
            for r in range(self.rows):
                if not self.done[r]:
                    self._end_row(r)
        if self.error is not None:
            raise self.error
