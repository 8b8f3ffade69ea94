"""Vocabularies: SentencePiece in T5's id layout, bytes as the zero-setup fallback, and the
reference's 13 digit ids of the synthetic tasks (:class:`DigitVocabulary`).

With no network there is no pretrained T5 vocabulary to download, so terra trains its own:
:func:`embedded_vocabulary` trains a SentencePiece model on the embedded corpus
(:mod:`terra.data.embedded`) on first use and caches it next to the corpus.

Every model trained here keeps ``"\\n"`` as a piece of its own and only applies Unicode NFKC
(no whitespace collapsing, byte fallback), so ``decode(encode(text)) == text`` for any
NFKC-normal text, tabs and newlines included. SentencePiece's default ``nmt_nfkc`` would turn
newlines and tabs into spaces, and ROUGE-Lsum, which splits summaries into sentences on newlines,
would then score decoded summaries differently from their references.

Train a model on your own text with ``terra-vocab`` (``python -m terra.cli.vocab``).
"""

import os
import uuid
from typing import Iterable, Iterator, Optional

import sentencepiece as spm
import seqio
import tensorflow as tf

from terra import files
from terra.data import embedded, python_vocabulary
from terra.errors import DataNotFoundError

# T5's layout: the model's own ids, with seqio appending sentinel <extra_id_*> ids on top.
PAD_ID, EOS_ID, UNK_ID, BOS_ID = 0, 1, 2, -1
DEFAULT_EMBEDDED_VOCAB_SIZE = 4000
DEFAULT_EXTRA_IDS = 100
# One document is one SentencePiece "sentence" (so its newlines reach the trainer); the
# default limit of 4,192 bytes would silently drop every longer document.
MAX_DOCUMENT_BYTES = 1 << 20


def sentencepiece_vocabulary(path: str, *, extra_ids: int = DEFAULT_EXTRA_IDS) -> seqio.SentencePieceVocabulary:
    """A seqio vocabulary over the SentencePiece model at ``path``, with ``extra_ids`` sentinels.

    Raises DataNotFoundError (a FileNotFoundError) naming the path when there is no model
    there, and InputError when the file there is not one
    (:func:`terra.data.python_vocabulary.read_sentencepiece_model`):
    seqio would only fail later, deep inside a tf.data pipeline or with a protobuf traceback; the
    commands report either in one line with exit status 2.
    """
    resolved = files.absolute(path)
    if not files.lexists(resolved):
        raise DataNotFoundError(
            f"SentencePiece model not found: {resolved!r}. A trained run needs the very file it was "
            "trained with (--vocabulary=FILE; runs keep a copy in vocabulary/sentencepiece.model). For a "
            f"new run, train one with `terra-vocab --embedded --out {resolved}` (or `--input FILE` for your "
            "own text), or use terra.data.vocabularies.embedded_vocabulary() for the built-in one."
        )
    python_vocabulary.read_sentencepiece_model(resolved)  # a regular file holding a model, or one error
    return seqio.SentencePieceVocabulary(resolved, extra_ids=extra_ids)


def byte_vocabulary(*, extra_ids: int = 0) -> seqio.ByteVocabulary:
    """UTF-8 bytes (ids 3..258 after pad/eos/unk): needs no file, so it always works."""
    return seqio.ByteVocabulary(extra_ids=extra_ids)


class DigitVocabulary(seqio.Vocabulary):
    """The reference's 13 ids of the synthetic tasks (Trax's ``addition_inputs`` and
    ``sequence_copy_inputs`` with ``vocab_size = 13``; ``docs/design/reference_code.md`` §7): pad 0,
    the digit ``k`` -> ``k + 1`` (1..10), ``"+"`` -> 11, the separator ``<S>`` -> 12. There is no
    EOS and no unknown id, as in the reference.

    Texts are strings of ``0-9``, ``+`` and ``<S>``; pad ids decode to nothing. A character outside
    them is an error (Python: ``ValueError``; in a ``tf.data`` pipeline, an ``InvalidArgumentError``
    naming this vocabulary).
    """

    SYMBOLS = "0123456789+"
    SEPARATOR = "<S>"
    PLUS_ID, SEPARATOR_ID = 11, 12

    def __init__(self):
        super().__init__(extra_ids=0)

    @property
    def _base_vocab_size(self) -> int:
        return len(self.SYMBOLS) + 2  # pad, the symbols, <S>

    @property
    def eos_id(self) -> Optional[int]:
        return None

    @property
    def unk_id(self) -> Optional[int]:
        return None

    def _encode(self, s: str):
        ids, rest = [], s
        while rest:
            if rest.startswith(self.SEPARATOR):
                ids.append(self.SEPARATOR_ID)
                rest = rest[len(self.SEPARATOR) :]
                continue
            if rest[0] not in self.SYMBOLS:
                raise ValueError(f"{rest[0]!r} is not one of the digit vocabulary's symbols {self.SYMBOLS!r} or <S>.")
            ids.append(self.SYMBOLS.index(rest[0]) + 1)
            rest = rest[1:]
        return ids

    def _decode(self, ids) -> str:
        table = ["", *self.SYMBOLS, self.SEPARATOR]
        return "".join(table[i] for i in ids if 0 <= i < len(table))

    def _encode_tf(self, s):
        # "<S>" becomes one byte (NUL, never a symbol), then each byte is looked up.
        raw = tf.strings.regex_replace(s, "<S>", "\x00")
        codes = tf.cast(tf.io.decode_raw(raw, tf.uint8), tf.int32)
        table = [-1] * 256
        table[0] = self.SEPARATOR_ID
        for i, symbol in enumerate(self.SYMBOLS):
            table[ord(symbol)] = i + 1
        ids = tf.gather(tf.constant(table, tf.int32), codes)
        check = tf.debugging.assert_non_negative(
            ids, message=f"a character outside the digit vocabulary's symbols {self.SYMBOLS!r} and <S>"
        )
        with tf.control_dependencies([check]):
            return tf.identity(ids)

    def _decode_tf(self, ids):
        table = tf.constant(["", *self.SYMBOLS, self.SEPARATOR])
        return tf.strings.reduce_join(tf.gather(table, ids), axis=-1)

    def __eq__(self, other) -> bool:
        return isinstance(other, DigitVocabulary)

    def __hash__(self) -> int:
        return hash(DigitVocabulary)


def digit_vocabulary() -> DigitVocabulary:
    """The reference's synthetic-task vocabulary (13 ids): :class:`DigitVocabulary`."""
    return DigitVocabulary()


def _documents(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text.strip():
            yield text


def train_sentencepiece(
    texts: Iterable[str],
    model_path: str,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    input_sentence_size: int = 2_000_000,
    num_threads: int = 2,
    hard_vocab_limit: bool = True,
    max_sentence_length: int = MAX_DOCUMENT_BYTES,
) -> str:
    """Trains a SentencePiece model on ``texts`` (one document each) and returns its ``.model`` path.

    T5 id layout (pad 0, eos 1, unk 2, no bos), full character coverage with byte fallback,
    and a lossless text mapping for NFKC text: ``"\\n"`` is a user-defined piece, whitespace is
    kept as is and only NFKC is applied (not ``identity``, whose empty character map makes
    every TF-text tokenizer load log a line). Each document is passed as one SentencePiece sentence (the
    trainer would otherwise split on newlines and never see one); documents longer than
    ``max_sentence_length`` bytes are skipped by the trainer. ``input_sentence_size`` caps
    how many documents are sampled.

    ``model_path`` may end in ``.model`` or be the prefix; ``.model`` and ``.vocab`` are
    written under temporary names and renamed into place, so a reader never sees a partial
    model. Raises RuntimeError from SentencePiece when, e.g., ``vocab_size`` is too large for
    the text with ``hard_vocab_limit=True``.
    """
    prefix = os.path.abspath(os.path.expanduser(model_path))
    if prefix.endswith(".model"):
        prefix = prefix[: -len(".model")]
    directory = os.path.dirname(prefix)
    os.makedirs(directory, exist_ok=True)
    tmp_prefix = os.path.join(directory, f".{os.path.basename(prefix)}.tmp-{uuid.uuid4().hex}")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_documents(texts),
            model_prefix=tmp_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            character_coverage=1.0,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            remove_extra_whitespaces=False,
            normalization_rule_name="nfkc",
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=max_sentence_length,
            num_threads=num_threads,
            hard_vocab_limit=hard_vocab_limit,
            minloglevel=2,
        )
        # The .model appears last, so its existence implies a complete pair.
        os.replace(tmp_prefix + ".vocab", prefix + ".vocab")
        os.replace(tmp_prefix + ".model", prefix + ".model")
    finally:
        for suffix in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
    return prefix + ".model"


def embedded_vocabulary_path(*, vocab_size: int = DEFAULT_EMBEDDED_VOCAB_SIZE, cache_dir: Optional[str] = None) -> str:
    """Where :func:`embedded_vocabulary` caches its model: next to the embedded corpus."""
    return os.path.join(embedded.corpus_dir(cache_dir=cache_dir), f"spm-unigram-{vocab_size}.model")


def embedded_vocabulary(
    *,
    vocab_size: int = DEFAULT_EMBEDDED_VOCAB_SIZE,
    extra_ids: int = DEFAULT_EXTRA_IDS,
    cache_dir: Optional[str] = None,
) -> seqio.SentencePieceVocabulary:
    """A unigram SentencePiece vocabulary trained on the embedded corpus's train split.

    Trained on first use and cached as ``spm-unigram-<vocab_size>.model`` next to the corpus;
    later calls load the cached file (training takes seconds; docs/data.md). The ~1.9 MB
    corpus supports at most ~12,600 pieces; larger sizes fail with "Vocabulary size too high".
    """
    path = embedded_vocabulary_path(vocab_size=vocab_size, cache_dir=cache_dir)
    if not os.path.isfile(path):
        corpus = embedded.build_corpus(cache_dir=cache_dir)
        with embedded.cache_writes(corpus), files.exclusive(f"{corpus}.spm-{vocab_size}.lock"):
            if not os.path.isfile(path):  # one trainer; the others wait for it
                texts = embedded.corpus_texts(split="train", cache_dir=cache_dir)
                train_sentencepiece(texts, path, vocab_size=vocab_size)
    return sentencepiece_vocabulary(path, extra_ids=extra_ids)
