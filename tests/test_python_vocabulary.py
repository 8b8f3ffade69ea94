"""terra's plain-Python SentencePiece vocabulary gives seqio's ids and texts (it replaces seqio
where a summarization run is opened without the data pipeline)."""

import seqio

from terra.data import vocabularies
from terra.data.python_vocabulary import PythonSentencePieceVocabulary

TEXTS = [
    "The os module provides a portable way of using operating system dependent functionality.",
    "Tabs\tand\nnewlines, ünïcödé, 数字 123 and <extra_id_3> a sentinel written as text.",
    "   leading spaces and <extra_id_0>ly a word-start sentinel",
    "",
]


def _model(tmp_path) -> str:
    corpus = [f"{text} {i}" for i in range(40) for text in TEXTS[:3]]
    return vocabularies.train_sentencepiece(
        corpus, str(tmp_path / "tiny.model"), vocab_size=400, hard_vocab_limit=False
    )


def test_encode_and_decode_equal_seqios_with_and_without_sentinels(tmp_path):
    path = _model(tmp_path)
    for extra_ids in (0, 7):
        ours, theirs = PythonSentencePieceVocabulary(path, extra_ids), seqio.SentencePieceVocabulary(path, extra_ids)
        assert (ours.vocab_size, ours.eos_id, ours.unk_id, ours.pad_id) == (
            theirs.vocab_size,
            theirs.eos_id,
            theirs.unk_id,
            0,
        )
        for text in TEXTS:
            assert ours.encode(text) == list(theirs.encode(text)), (extra_ids, text)
            assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
        top = theirs.vocab_size
        for ids in ([5, 6, 7, 1, 9, 10], list(range(top - 10, top + 5)), [top - 1, 2, top + 100], []):
            assert ours.decode(ids) == theirs.decode(ids), (extra_ids, ids)
