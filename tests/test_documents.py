"""The documents terra-summarize reads: plain text, Cohan JSON lines recognised by their first
line (a bad line is an error naming it, never plain text), standard input, and clear errors."""

import io
import json

import pytest

from terra.documents import read_documents, split_documents
from terra.errors import InputError


def _paper(i: int) -> str:
    return json.dumps({"article_id": f"paper{i}", "article_text": [f"sentence {i} .", "more ."], "abstract_text": []})


def test_plain_text_is_one_document():
    assert split_documents("A plain note.\n{ not JSON at the start }", "note.txt") == [
        ("note.txt", "A plain note.\n{ not JSON at the start }")
    ]


def test_json_lines_are_one_document_per_paper():
    docs = split_documents(f"{_paper(1)}\n\n{_paper(2)}\n", "papers.jsonl")
    assert docs == [
        ("papers.jsonl [paper1]", "sentence 1 .\nmore ."),
        ("papers.jsonl [paper2]", "sentence 2 .\nmore ."),
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"article_id": "x", "article_text": ["cut off', "papers.jsonl, line 3: not valid JSON"),
        ('{"article_id": "x", "abstract_text": []}', "papers.jsonl, line 3: a Cohan JSON line needs an 'article_text'"),
        ('["a list"]', "needs an 'article_text' list of sentences, not a list"),
        ('{"article_text": null}', "papers.jsonl, line 3: .*\\('article_text' is null\\)"),
        (
            '{"article_text": ["ok", 7]}',
            "papers.jsonl, line 3: .*\\('article_text' sentence 1 is a int, not a string\\)",
        ),
    ],
)
def test_a_bad_line_in_json_lines_is_an_error_naming_it_not_plain_text(bad_line, message):
    text = "\n".join([_paper(1), _paper(2), bad_line, _paper(4)])
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        split_documents(text, "papers.jsonl")


def test_read_documents_names_every_unusable_file(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(_paper(7) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_paper(1) + "\n" + '{"article_text": "one string"}\n')
    with pytest.raises(InputError) as e:
        read_documents([str(good), str(bad), str(tmp_path / "missing.txt")])
    assert "bad.jsonl, line 2" in str(e.value) and "missing.txt: cannot be read" in str(e.value)
    assert read_documents(["-"], stdin=io.BytesIO(_paper(3).encode())) == [
        ("standard input [paper3]", "sentence 3 .\nmore .")
    ]


@pytest.mark.parametrize(
    "data, words",
    [
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj", "is not text: it is a PDF; extract its text first, e.g. `pdftotext"),
        (b"\x1f\x8b\x08\x00" + bytes(20), "is not text: it is gzip-compressed; decompress it first"),
        (b"ELF\x02\x01\x01\x00\x00\x00\x00", "is not text: it is a binary file (it holds NUL bytes)"),
        (b"caf\xe9 au lait", "is not UTF-8 text (byte 0xe9 at offset 3); convert it first, e.g. `iconv"),
    ],
)
def test_a_binary_file_is_named_for_what_it_is_and_only_latin1_text_gets_iconv(tmp_path, data, words):
    path = tmp_path / "paper.pdf"
    path.write_bytes(data)
    with pytest.raises(InputError) as error:
        read_documents([str(path)])
    assert f"{path} {words}" in str(error.value)
    assert ("iconv" in str(error.value)) == (b"caf" in data)


def test_a_document_past_the_limit_is_read_only_that_far(monkeypatch):
    import terra.documents as documents

    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 1000)
    with pytest.raises(InputError, match="standard input holds more than 1000 bytes; a document to summarize is text"):
        read_documents(["-"], stdin=io.BytesIO(b"word " * 10_000))
