"""A SentencePiece vocabulary in plain Python (the ``sentencepiece`` package only): the ids and
texts of ``seqio.SentencePieceVocabulary``, without seqio or TensorFlow, for a process that
encodes and decodes texts but builds no input pipeline (``terra.load`` of a summarization run,
``terra-summarize``). Loading TensorFlow takes seconds; this takes milliseconds.

seqio's form is reproduced exactly: ``extra_ids`` sentinel pieces ``▁<extra_id_N>`` appended to
the model as user-defined pieces, numbered down from the top id (T5's span corruption); encode
is the processor's ``EncodeAsIds``; decode maps ids past the pieces to UNK, stops after the
first EOS and calls ``DecodeIds``. ``tests/test_python_vocabulary.py`` compares the two.
"""

import functools
import os
from typing import Iterable, List, Type

import sentencepiece as spm
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from terra import files
from terra.errors import InputError

# A SentencePiece model file: T5's 32k model is 0.8 MB, a 256k-piece model about 4 MB.
MAX_MODEL_BYTES = 64 << 20


def read_sentencepiece_model(path: str, error: Type[Exception] = InputError) -> sentencepiece_model_pb2.ModelProto:
    """The model at ``path``, checked: a regular file of at most :data:`MAX_MODEL_BYTES` holding a
    SentencePiece model with at least T5's three special pieces (pad, eos, unk). A model is a
    protobuf message, so reading it runs nothing, and the size is checked first: a device, a FIFO
    or a sparse multi-gigabyte file is refused without being read. Raises ``error``."""
    what = "the SentencePiece model"
    data = files.read_regular_file(path, MAX_MODEL_BYTES, error, what)
    try:
        model = sentencepiece_model_pb2.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        model = None
    if model is None or len(model.pieces) < 3:
        found = "no model" if model is None else f"a model of {len(model.pieces)} pieces"
        raise error(
            f"{what} {path} is not a SentencePiece model ({found}; a damaged or truncated file, or another "
            "kind of file). Give the .model file the vocabulary was trained into (terra-vocab writes one; runs "
            "keep a copy in vocabulary/sentencepiece.model)."
        )
    return model


def _processor(path: str, extra_ids: int) -> spm.SentencePieceProcessor:
    status = os.stat(path) if not files.has_scheme(path) else None
    stamp = (status.st_mtime_ns, status.st_size) if status else None
    return _cached_processor(path, extra_ids, stamp)


@functools.lru_cache(maxsize=8)
def _cached_processor(path: str, extra_ids: int, stamp) -> spm.SentencePieceProcessor:
    """One processor per file (as it is on disk: ``stamp``) and sentinel count."""
    model = read_sentencepiece_model(path)
    for i in reversed(range(extra_ids)):  # seqio's order: <extra_id_0> is the top id
        model.pieces.add(
            piece=f"▁<extra_id_{i}>", score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
        )
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model.SerializeToString())
    return processor


class PythonSentencePieceVocabulary:
    """The SentencePiece model at ``sentencepiece_model_file`` with ``extra_ids`` sentinels, as
    ``seqio.SentencePieceVocabulary(sentencepiece_model_file, extra_ids)`` encodes and decodes
    Python strings (no ``tf.data`` forms)."""

    def __init__(self, sentencepiece_model_file: str, extra_ids: int = 0):
        self.sentencepiece_model_file = sentencepiece_model_file
        self.extra_ids = extra_ids
        self._processor = _processor(sentencepiece_model_file, extra_ids)

    @property
    def vocab_size(self) -> int:
        """Every id, the sentinels included (seqio's ``vocab_size``)."""
        return self._processor.GetPieceSize()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def unk_id(self) -> int:
        return self._processor.unk_id()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    def encode(self, text: str) -> List[int]:
        """The ids of ``text``, without EOS."""
        return self._processor.EncodeAsIds(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` up to and including the first EOS (ids past the model are UNK)."""
        size, unk = self.vocab_size, self.unk_id
        clean = [unk if int(i) >= size else int(i) for i in ids]
        if self.eos_id in clean:
            clean = clean[: clean.index(self.eos_id) + 1]
        return self._processor.DecodeIds(clean)

    def __repr__(self) -> str:
        return f"PythonSentencePieceVocabulary({self.sentencepiece_model_file!r}, extra_ids={self.extra_ids})"
