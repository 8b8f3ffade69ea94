"""Streaming's host side (terra/decoding/streaming.py): text held back until its words are whole,
each row followed to its EOS, a receiver's error ending the loop. The streams of a real model's
generation loop are tested through the API (tests/test_api.py)."""

import numpy as np
import pytest

from terra.decoding.streaming import BatchStream, RowText


class PieceVocabulary:
    """SentencePiece's way with words: "▁" starts a word, a word may take several pieces, and
    the decoded text has no leading space."""

    PIECES = ["<pad>", "</s>", "▁Sparse", "▁lay", "ers", "▁dec", "ode", "▁fast", ".", "\n", "▁", "日", "本", "▁é"]

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids).replace("▁", " ").lstrip(" ")


def _pieces_of(ids, vocabulary):
    row = RowText(vocabulary)
    pieces = [row.add(i) for i in ids]
    return pieces, row.finish()


def test_row_text_prints_whole_words_and_its_pieces_join_to_the_decoded_text():
    vocabulary = PieceVocabulary()
    ids = [2, 3, 4, 5, 6, 7, 8, 9, 3, 4]  # "Sparse layers decode fast.\n layers"
    pieces, rest = _pieces_of(ids, vocabulary)
    # "▁lay" alone is half a word: nothing new is printed until the next word starts.
    assert pieces[:5] == ["", "Sparse ", "", "layers ", ""]
    assert pieces[5:8] == ["decode ", "", "fast.\n"]  # a line end prints what precedes it at once
    assert "".join(pieces) + rest == vocabulary.decode(ids)
    assert all(not p or p.endswith((" ", "\n")) for p in pieces)


def test_row_text_prints_cjk_characters_as_they_come():
    vocabulary = PieceVocabulary()
    pieces, rest = _pieces_of([11, 12], vocabulary)
    assert pieces == ["日", "本"] and rest == ""


class ByteFallbackVocabulary:
    """A character split into byte pieces decodes to U+FFFD until its last byte arrives."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_row_text_holds_a_character_back_until_its_bytes_are_complete():
    data = "café au lait".encode()
    pieces, rest = _pieces_of(list(data), ByteFallbackVocabulary())
    assert "".join(pieces) + rest == "café au lait"
    assert not any("\ufffd" in p for p in pieces) and pieces[5] == "café "


def test_a_batch_stream_follows_each_row_to_its_eos_and_ignores_pad_rows():
    got = []
    stream = BatchStream(lambda row, piece: got.append((row, piece)), rows=2, eos_id=1, first_row=4)
    steps = np.array([[7, 8, 5], [1, 9, 5], [0, 1, 5]])  # row 0 ends at step 1; row 1 at 2; row 2 pads
    assert [stream(i, tokens) for i, tokens in enumerate(steps)] == [False] * 3
    stream.finish()
    assert got == [(4, 7), (5, 8), (5, 9)]


def test_a_receivers_error_stops_the_loop_and_is_raised_after_it():
    def refuse(row, piece):
        raise BrokenPipeError("the reader went away")

    stream = BatchStream(refuse, rows=1, eos_id=1, vocabulary=PieceVocabulary())
    assert stream(0, np.array([2])) is False  # "Sparse" is not whole yet: nothing handed over
    assert stream(1, np.array([3])) is True  # "Sparse " is: the receiver fails, the loop stops
    assert stream(2, np.array([4])) is True
    with pytest.raises(BrokenPipeError, match="went away"):
        stream.finish()
