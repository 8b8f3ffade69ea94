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
