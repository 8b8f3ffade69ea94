"""The embedded default corpus: real English text that ships with Python itself.

terra must train, evaluate and run its tests with no network access, so the default
corpus is built from text every Python installation already has, read *without importing
the modules it comes from* (importing the whole standard library is slow and has side
effects):

* ``pydoc_data.topics.topics``, the language-reference topics behind ``help()``
  (a plain data module, so importing it is harmless);
* the docstrings of the standard library's ``.py`` files, read with :mod:`ast`.

From these come two seqio-readable corpora, written once to a cache directory as TFRecord
files of ``tf.train.Example`` (so :class:`seqio.TFExampleDataSource` reads them and the
``tf.data`` iterators over them are checkpointable):

* language modelling: one document per topic or docstring (feature ``text``);
* summarization (features ``article``, ``abstract``, ``kind``, ``id``):

  - ``kind=b"docstring"``: a docstring's body -> its first paragraph (the summary line);
  - ``kind=b"module"``: all of a module's docstrings joined -> the module docstring's first
    paragraph, long inputs that resemble long-document (arXiv-style) summarization;
  - ``id`` names where the pair comes from, unique and the same in every build:
    ``b"docstring:textwrap.py:TextWrapper.wrap"`` (the module's path in the standard
    library, then the dotted names of the enclosing classes and functions; none for the module
    docstring itself), ``b"module:json/__init__.py"``; ``#2``, ``#3``, ... follow a name that
    occurs again in the same module (e.g. a function defined in both branches of an ``if``).

  Articles keep their newlines: ROUGE-Lsum splits summaries into sentences on newlines, so a
  pipeline that loses them scores differently.

The text is determined by the Python version, so the cache directory is keyed by it (and by
:data:`FORMAT_VERSION`). On CPython 3.11.7: 1.92 MB of text in 5,717 documents (79 topics,
5,638 distinct docstrings) and 1,943 summarization pairs (1,794 docstring, 149 module; module
articles have a median of ~690 words), built in seconds (mostly ``ast.parse``),
byte-identical across builds.
Train/validation membership is a hash of the text, stable across machines and runs.
"""

import ast
import contextlib
import dataclasses
import errno
import hashlib
import inspect
import json
import os
import platform
import re
import shutil
import sys
import sysconfig
import tempfile
import warnings
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import seqio
import tensorflow as tf

from terra import files
from terra.errors import StorageError

# Bump when the extraction or the file layout changes: caches of an older format are
# then ignored rather than misread.
FORMAT_VERSION = 2  # 2: summarization pairs have an ``id``

SPLITS = ("train", "validation")
VALIDATION_PERCENT = 5
MANIFEST = "manifest.json"

LM_FEATURES = {"text": tf.io.FixedLenFeature([], tf.string)}
SUMMARIZATION_FEATURES = {
    "article": tf.io.FixedLenFeature([], tf.string),
    "abstract": tf.io.FixedLenFeature([], tf.string),
    "kind": tf.io.FixedLenFeature([], tf.string),
    "id": tf.io.FixedLenFeature([], tf.string),
}

# Tests, GUI code and vendored packages are mostly code-like or duplicated text.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip", "pydoc_data"}
)
_MIN_DOCSTRING_CHARS = 40
_SUMMARY_WORDS = (3, 40)
_MIN_BODY_WORDS = 20
_MIN_MODULE_ARTICLE_WORDS = 200
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STATEMENT_FIELDS = ("body", "handlers", "orelse", "finalbody", "cases")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclasses.dataclass(frozen=True)
class _Pair:
    article: str
    abstract: str
    kind: str
    split: str
    id: str


def split_of(text: str) -> str:
    """``'validation'`` for ~5% of texts, chosen by sha256 (stable, unlike ``hash()``)."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return "validation" if int(digest, 16) % 100 < VALIDATION_PERCENT else "train"


def corpus_dir(*, cache_dir: Optional[str] = None) -> str:
    """Where the corpus for this Python lives: ``<cache root>/embedded-<python>-v<format>``.

    The cache root is ``cache_dir``, else ``$TERRA_CACHE_DIR``, else ``~/.cache/terra``.
    """
    root = cache_dir if cache_dir is not None else os.environ.get("TERRA_CACHE_DIR", "~/.cache/terra")
    root = os.path.abspath(os.path.expanduser(root))
    name = f"embedded-{sys.implementation.name}-{platform.python_version()}-v{FORMAT_VERSION}"
    return os.path.join(root, name)


def _stdlib_docstrings() -> List[Tuple[str, List[Tuple[str, str]]]]:
    """``[(module path relative to the stdlib, [(name, docstring) in source order])]``, the
    module docstring (name ``""``) first; see :func:`_docstrings_in_source_order`."""
    root = sysconfig.get_paths()["stdlib"]
    modules = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's order, which otherwise follows the filesystem.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and d != "__pycache__")
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = os.path.join(dirpath, filename)
            with open(path, "rb") as f:
                source = f.read()
            try:
                with warnings.catch_warnings():
                    # Invalid escape sequences in old modules warn on parse; the text is still fine.
                    warnings.simplefilter("ignore")
                    tree = ast.parse(source, filename=path)
            except (SyntaxError, ValueError):
                # Template or deliberately broken files (bad encodings, Python 2 syntax).
                continue
            modules.append((os.path.relpath(path, root).replace(os.sep, "/"), _docstrings_in_source_order(tree)))
    return modules


def _docstrings_in_source_order(tree: ast.Module) -> List[Tuple[str, str]]:
    """``[(name, docstring)]``: the name is the dotted path of the enclosing classes and
    functions (``""`` for the module docstring), with ``#2``, ``#3``, ... when a name repeats."""
    docs: List[Tuple[str, str]] = []
    seen: Dict[str, int] = {}
    stack: List[Tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, name = stack.pop()
        if isinstance(node, _DOCSTRING_NODES):
            if not isinstance(node, ast.Module):
                name = f"{name}.{node.name}" if name else node.name
            doc = ast.get_docstring(node, clean=False)
            doc = inspect.cleandoc(doc) if doc is not None else ""
            if len(doc) >= _MIN_DOCSTRING_CHARS:
                seen[name] = seen.get(name, 0) + 1
                docs.append((name if seen[name] == 1 else f"{name}#{seen[name]}", doc))
            elif isinstance(node, ast.Module):
                # Holds the module's place, so a function's docstring is never taken for the module's.
                docs.append(("", ""))
        # Docstrings only open statement lists, so expressions (most of the tree) are skipped.
        children = [c for f in _STATEMENT_FIELDS if isinstance(getattr(node, f, None), list) for c in getattr(node, f)]
        stack.extend((child, name) for child in reversed(children))
    return docs


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _split_summary(doc: str) -> Optional[Tuple[str, str]]:
    """``(first paragraph on one line, rest)``, or None when the first paragraph is not a summary."""
    parts = _PARAGRAPH_BREAK.split(doc.strip(), maxsplit=1)
    summary = _one_line(parts[0])
    rest = parts[1].strip() if len(parts) == 2 else ""
    if not _SUMMARY_WORDS[0] <= len(summary.split()) <= _SUMMARY_WORDS[1]:
        return None
    return summary, rest


def _extract() -> Tuple[List[str], List[str], List[_Pair], Dict[str, int]]:
    """``(lm documents, their splits, summarization pairs, source statistics)``, deterministic."""
    from pydoc_data.topics import topics  # A data module: importing it runs no library code.

    documents: List[str] = [topics[key] for key in sorted(topics)]
    seen = set(documents)
    modules = _stdlib_docstrings()
    pairs: List[_Pair] = []
    n_docstrings = n_duplicates = 0
    for path, docs in modules:
        for name, doc in docs:
            if not doc:
                continue
            n_docstrings += 1
            # Identical docstrings (re-exported or copied APIs) would otherwise weight the
            # corpus and duplicate summarization pairs.
            if doc in seen:
                n_duplicates += 1
                continue
            seen.add(doc)
            documents.append(doc)
            summary = _split_summary(doc)
            if summary is not None and len(summary[1].split()) >= _MIN_BODY_WORDS:
                # Split by the whole docstring so a validation pair's source is also validation text.
                pair_id = f"docstring:{path}:{name}" if name else f"docstring:{path}"
                pairs.append(
                    _Pair(article=summary[1], abstract=summary[0], kind="docstring", split=split_of(doc), id=pair_id)
                )
    for path, named_docs in modules:
        docs = [doc for _, doc in named_docs]
        if not docs or not docs[0]:
            continue
        summary = _split_summary(docs[0])
        if summary is None:
            continue
        article = "\n\n".join(d for d in [summary[1], *docs[1:]] if d)
        if len(article.split()) >= _MIN_MODULE_ARTICLE_WORDS:
            pairs.append(
                _Pair(article=article, abstract=summary[0], kind="module", split=split_of(article), id=f"module:{path}")
            )
    stats = {
        "pydoc_topics": len(topics),
        "stdlib_modules": len(modules),
        "stdlib_docstrings": n_docstrings,
        "duplicate_docstrings_dropped": n_duplicates,
    }
    return documents, [split_of(d) for d in documents], pairs, stats


def _example(features: Mapping[str, str]) -> bytes:
    feature = {
        key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode("utf-8")]))
        for key, value in features.items()
    }
    # Deterministic serialization keeps the files byte-identical across builds.
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(deterministic=True)


def _write_records(path: str, records: Sequence[bytes]) -> None:
    with tf.io.TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_corpus(directory: str) -> None:
    documents, doc_splits, pairs, stats = _extract()
    text_digest = hashlib.sha256()
    for doc in documents:
        data = doc.encode("utf-8")
        # Length-prefixed, so the digest identifies the document boundaries as well as the text.
        text_digest.update(len(data).to_bytes(8, "little") + data)
    manifest: Dict[str, object] = {
        "format_version": FORMAT_VERSION,
        "python": f"{sys.implementation.name}-{platform.python_version()}",
        "sources": stats,
        "text_bytes": sum(len(d.encode("utf-8")) for d in documents),
        "text_sha256": text_digest.hexdigest(),
        "lm": {},
        "summarization": {},
        "files": {},
    }
    for split in SPLITS:
        docs = [d for d, s in zip(documents, doc_splits) if s == split]
        _write_records(os.path.join(directory, f"lm-{split}.tfrecord"), [_example({"text": d}) for d in docs])
        manifest["lm"][split] = {"documents": len(docs), "bytes": sum(len(d.encode("utf-8")) for d in docs)}
        split_pairs = [p for p in pairs if p.split == split]
        _write_records(
            os.path.join(directory, f"summarization-{split}.tfrecord"),
            [_example({"article": p.article, "abstract": p.abstract, "kind": p.kind, "id": p.id}) for p in split_pairs],
        )
        manifest["summarization"][split] = {
            "pairs": len(split_pairs),
            "docstring": sum(p.kind == "docstring" for p in split_pairs),
            "module": sum(p.kind == "module" for p in split_pairs),
        }
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        manifest["files"][name] = {"bytes": os.path.getsize(path), "sha256": _file_sha256(path)}
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


def build_corpus(*, cache_dir: Optional[str] = None) -> str:
    """Builds the corpus unless already cached; returns its directory (see :func:`corpus_dir`).

    The corpus is written to a temporary sibling directory and renamed into place, so an
    interrupted build never leaves a directory that looks complete; concurrent builders (several
    test workers or jobs) take a lock beside it, so one builds and the others read its copy.
    """
    target = corpus_dir(cache_dir=cache_dir)
    if os.path.isfile(os.path.join(target, MANIFEST)):
        return target
    with cache_writes(target):
        with files.exclusive(target + ".lock"):
            if not os.path.isfile(os.path.join(target, MANIFEST)):  # built while this process waited
                _build_into(target)
    return target


@contextlib.contextmanager
def cache_writes(target: str):
    """Turns a write refused under the cache (a read-only home folder, a full disk, no
    permission, a file where a folder should be) into a :class:`~terra.errors.StorageError` that names the cache and the
    variable that moves it, ``TERRA_CACHE_DIR``."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR):
            raise
        raise StorageError(
            f"cannot write terra's cache {os.path.dirname(target)} ({error.strerror}: {error.filename or target}). "
            "The embedded corpus and its vocabulary are built there once; set TERRA_CACHE_DIR to a writable folder "
            "(or pass a cache_dir) and run the command again."
        ) from None


def _build_into(target: str) -> None:
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    # mkdtemp makes the directory private; the finished cache is as readable as any other.
    os.chmod(tmp, 0o755)
    try:
        _write_corpus(tmp)
        if os.path.isdir(target):
            # A directory without a manifest is not ours to trust (made by hand or by an older tool).
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, MANIFEST)):
                raise
            # Another process finished first; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(*, cache_dir: Optional[str] = None) -> dict:
    """The corpus manifest (counts, bytes, sha256 of text and files), building the corpus if needed."""
    with open(os.path.join(build_corpus(cache_dir=cache_dir), MANIFEST), encoding="utf-8") as f:
        return json.load(f)


def _source(prefix: str, features: Mapping[str, tf.io.FixedLenFeature], counts: Mapping[str, int], directory: str):
    return seqio.TFExampleDataSource(
        split_to_filepattern={split: os.path.join(directory, f"{prefix}-{split}.tfrecord") for split in SPLITS},
        feature_description=dict(features),
        num_input_examples=dict(counts),
    )


def lm_source(*, cache_dir: Optional[str] = None) -> seqio.TFExampleDataSource:
    """The language-modelling documents (feature ``text``), splits ``train``/``validation``."""
    manifest = read_manifest(cache_dir=cache_dir)
    counts = {split: manifest["lm"][split]["documents"] for split in SPLITS}
    return _source("lm", LM_FEATURES, counts, corpus_dir(cache_dir=cache_dir))


def summarization_source(*, cache_dir: Optional[str] = None) -> seqio.TFExampleDataSource:
    """Summarization pairs (features ``article``, ``abstract``, ``kind``, ``id``), splits ``train``/``validation``."""
    manifest = read_manifest(cache_dir=cache_dir)
    counts = {split: manifest["summarization"][split]["pairs"] for split in SPLITS}
    return _source("summarization", SUMMARIZATION_FEATURES, counts, corpus_dir(cache_dir=cache_dir))


def corpus_texts(*, split: str = "train", cache_dir: Optional[str] = None) -> Iterator[str]:
    """The language-modelling documents of ``split`` as Python strings, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = os.path.join(build_corpus(cache_dir=cache_dir), f"lm-{split}.tfrecord")
    for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
        yield tf.train.Example.FromString(record).features.feature["text"].bytes_list.value[0].decode("utf-8")
