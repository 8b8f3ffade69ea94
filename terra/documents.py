"""The documents a user asks terra to summarize: plain text, Cohan-format JSON lines (one paper
per line with ``article_text``, as the arXiv release) or standard input. Pure Python: reading
documents imports nothing heavy, so bad input is reported before a model is loaded."""

import json
import sys
from typing import List, Optional, Sequence, Tuple

from terra.errors import InputError
from terra.files import describe_size
from terra.text_encoding import clean_article

# The most a document may hold: an arXiv paper is about 60 KB of text, a long book a few MB.
MAX_DOCUMENT_BYTES = 256 << 20
# Files people pass by mistake, by their first bytes: what they are and how to get their text.
_BINARY_KINDS = (
    (b"%PDF-", "a PDF", "extract its text first, e.g. `pdftotext {name} {name}.txt`"),
    (b"\x1f\x8b", "gzip-compressed", "decompress it first, e.g. `gunzip -k {name}`"),
    (b"PK\x03\x04", "a zip archive (or a .docx/.odt document)", "extract the text first"),
    (b"\x89PNG", "a PNG image", "give the document's text"),
    (b"\xff\xd8\xff", "a JPEG image", "give the document's text"),
)


def _binary_kind(data: bytes, name: str) -> Optional[str]:
    """What a file that is not text is, with how to get its text; None for text. A NUL byte in
    the first 8 KB marks a binary file (UTF-8 text never holds one)."""
    for magic, kind, fix in _BINARY_KINDS:
        if data.startswith(magic):
            return f"{kind}; {fix.format(name=name)}"
    if b"\0" in data[:8192]:
        return "a binary file (it holds NUL bytes); give the document's text"
    return None


def _decode_utf8(data: bytes, name: str) -> str:
    kind = _binary_kind(data, name)
    if kind:
        raise InputError(f"{name} is not text: it is {kind}.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it first, "
            f"e.g. `iconv -f latin1 -t utf-8 {name} > {name}.utf8`."
        ) from None


def cohan_field_problem(record: dict, field: str) -> Optional[str]:
    """Why ``record[field]`` is not a list of sentence strings (``article_text``,
    ``abstract_text``), or None when it is."""
    if field not in record:
        return f"no '{field}' field"
    value = record[field]
    if value is None:
        return f"'{field}' is null"
    if not isinstance(value, list):
        return f"'{field}' is a {type(value).__name__}, not a list of sentences"
    odd = [i for i, sentence in enumerate(value) if not isinstance(sentence, str)]
    if odd:
        kind = "null" if value[odd[0]] is None else f"a {type(value[odd[0]]).__name__}"
        return f"'{field}' sentence {odd[0]} is {kind}, not a string"
    return None


def cohan_example(record: dict) -> dict:
    """One Cohan et al. JSON record -> the TFDS ``scientific_papers`` features: sentences joined
    by newlines, ``<S>``/``</S>`` removed and each abstract line stripped (the TFDS builder
    leaves the spaces around each sentence); plus ``id``, the record's ``article_id``, which the
    TFDS builder drops."""
    abstract = [s.replace("<S>", "").replace("</S>", "").strip() for s in record.get("abstract_text") or []]
    return {
        "article": "\n".join(record.get("article_text") or []),
        "abstract": "\n".join(s for s in abstract if s),
        "section_names": "\n".join(record.get("section_names") or []),
        "id": str(record.get("article_id") or ""),
    }


def split_documents(text: str, name: str) -> List[Tuple[str, str]]:
    """``[(label, article text)]``: Cohan JSON lines (one paper each) when the first non-empty
    line starts with ``{``, else the whole plain text. A file that starts as JSON lines is read
    as JSON lines to the end: a line that is not a JSON object with an ``article_text`` list is an
    ``InputError`` naming the line, never a reason to summarize the raw JSON as text."""
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not numbered or not numbered[0][1].lstrip().startswith("{"):
        return [(name, text)]
    docs = []
    for i, (n, line) in enumerate(numbered):
        where = f"{name}, line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); the file starts as Cohan JSON lines "
                "(one paper per line), so every line must be one."
            ) from None
        if not isinstance(record, dict):
            raise InputError(
                f"{where}: a Cohan JSON line needs an 'article_text' list of sentences, not a {type(record).__name__}."
            )
        problem = cohan_field_problem(record, "article_text")
        if problem:
            raise InputError(f"{where}: a Cohan JSON line needs an 'article_text' list of sentences ({problem}).")
        docs.append((f"{name} [{record.get('article_id', i)}]", cohan_example(record)["article"]))
    return docs


def read_documents(paths: Sequence[str], stdin=None, *, partial: bool = False):
    """Every document of every path (``-`` is standard input); raises ``InputError`` naming
    each unusable file. ``partial``: returns ``(documents, problems)`` instead, the usable
    documents and a line per unusable file, and raises only when no document is usable."""
    docs, problems = [], []
    for path in paths:
        name = "standard input" if path == "-" else path
        try:
            if path == "-":
                data = (stdin or sys.stdin.buffer).read(MAX_DOCUMENT_BYTES + 1)
            else:  # a pipe is fine (<(...) in a shell); a device or a huge file is read only this far
                with open(path, "rb") as f:
                    data = f.read(MAX_DOCUMENT_BYTES + 1)
            if len(data) > MAX_DOCUMENT_BYTES:
                raise InputError(
                    f"{name} holds more than {describe_size(MAX_DOCUMENT_BYTES)}; a document to summarize is text of a "
                    "few MB at most (the model reads its first tokens), so it was not read further."
                )
            found = split_documents(_decode_utf8(data, name), name)
            for label, text in found:
                if not clean_article(text):
                    raise InputError(f"{label} is empty: there is no text to summarize.")
            docs += found
        except OSError as e:
            problems.append(f"{name}: cannot be read ({e.strerror or e}).")
        except InputError as e:
            problems.append(str(e))
    if problems and (not partial or not docs):
        raise InputError("nothing was summarized:\n  " + "\n  ".join(problems))
    return (docs, problems) if partial else docs
