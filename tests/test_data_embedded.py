"""The embedded corpus and the vocabularies: what lets terra train and test with no network.

The corpus and its vocabulary are the test session's (conftest's TERRA_CACHE_DIR, a temporary
cache every task of the embedded corpus reads, built once per session: a few seconds each); one
test builds a second copy to compare. The checks on newlines matter because ROUGE-Lsum splits
summaries on them.
"""

import ast
import concurrent.futures
import functools
import json
import os
import re
import runpy
import subprocess
import sys
import time
import warnings

import pytest
import sentencepiece as spm

from terra import process_memory
from terra.cli import app
from terra.cli import vocab as vocab_cli
from terra.data import embedded, vocabularies, vocabulary_training
from terra.errors import DataNotFoundError

from helpers import REPO_ROOT

NEWLINE_TEXT = "first sentence .\nsecond sentence ."
UNICODE_TEXT = "naïve café — ☃ 日本語 😀\ttabbed\n\n  indented line  "


@pytest.fixture(scope="module")
def cache_root():
    """The session's cache (conftest sets TERRA_CACHE_DIR to a temporary folder): the corpus
    and vocabulary the tasks read, built once per test session by whichever test needs them first."""
    root = os.environ["TERRA_CACHE_DIR"]
    embedded.build_corpus(cache_dir=root)
    return root


@pytest.fixture(scope="module")
def vocab(cache_root):
    return vocabularies.embedded_vocabulary(cache_dir=cache_root)


def _manifest(directory):
    with open(os.path.join(directory, embedded.MANIFEST), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.slow
def test_embedded_corpus_is_large_and_identical_across_two_builds(cache_root, tmp_path):
    first = embedded.build_corpus(cache_dir=cache_root)
    second = embedded.build_corpus(cache_dir=str(tmp_path))
    assert first != second
    manifest = _manifest(first)
    assert manifest["text_bytes"] >= 1_000_000
    assert manifest == _manifest(second)
    for name, entry in manifest["files"].items():
        with open(os.path.join(second, name), "rb") as a, open(os.path.join(first, name), "rb") as b:
            assert a.read() == b.read(), name
        assert entry["bytes"] > 0
    # No temporary build directories are left beside the corpus (only the builders' lock file).
    assert sorted(os.listdir(str(tmp_path))) == [os.path.basename(second), os.path.basename(second) + ".lock"]
    texts = {split: list(embedded.corpus_texts(split=split, cache_dir=cache_root)) for split in embedded.SPLITS}
    assert sum(len(t.encode("utf-8")) for ts in texts.values() for t in ts) == manifest["text_bytes"]
    assert len(texts["train"]) > 5_000 and len(texts["validation"]) > 100
    assert not set(texts["train"]) & set(texts["validation"])
    assert all(embedded.split_of(t) == "validation" for t in texts["validation"])
    assert sum("\n" in t for t in texts["train"]) > len(texts["train"]) // 2


@pytest.mark.slow
def test_embedded_corpus_has_at_least_a_thousand_summarization_pairs(cache_root):
    source = embedded.summarization_source(cache_dir=cache_root)
    manifest = _manifest(embedded.corpus_dir(cache_dir=cache_root))["summarization"]
    assert manifest["train"]["pairs"] + manifest["validation"]["pairs"] >= 1_000
    for split in embedded.SPLITS:
        assert manifest[split]["docstring"] > 0 and manifest[split]["module"] > 0
    pairs = list(source.get_dataset(split="validation", shuffle=False).as_numpy_iterator())
    assert len(pairs) == manifest["validation"]["pairs"] == source.num_input_examples("validation")
    assert {p["kind"] for p in pairs} == {b"docstring", b"module"}
    for p in pairs:
        abstract, article = p["abstract"].decode(), p["article"].decode()
        assert 3 <= len(abstract.split()) <= 40 and "\n" not in abstract
        assert len(article.split()) > len(abstract.split())
    modules = [p["article"].decode() for p in pairs if p["kind"] == b"module"]
    assert all(len(a.split()) >= 200 and "\n" in a for a in modules)


def test_sources_read_through_seqio(cache_root):
    lm = embedded.lm_source(cache_dir=cache_root)
    assert set(lm.splits) == {"train", "validation"}
    (example,) = lm.get_dataset(split="train", shuffle=False).take(1).as_numpy_iterator()
    assert set(example) == {"text"} and len(example["text"]) >= 40
    assert example["text"].decode() == next(embedded.corpus_texts(split="train", cache_dir=cache_root))
    summarization = embedded.summarization_source(cache_dir=cache_root)
    (pair,) = summarization.get_dataset(split="train", shuffle=True, seed=0).take(1).as_numpy_iterator()
    assert set(pair) == {"article", "abstract", "kind", "id"}
    assert pair["kind"] in (b"docstring", b"module")
    assert pair["id"].startswith(pair["kind"] + b":")


def test_summarization_pairs_have_unique_ids_naming_their_origin(cache_root):
    source = embedded.summarization_source(cache_dir=cache_root)
    pairs = [p for split in embedded.SPLITS for p in source.get_dataset(split=split, shuffle=False).as_numpy_iterator()]
    ids = [p["id"].decode() for p in pairs]
    assert len(set(ids)) == len(ids) == len(pairs)
    for pair, pair_id in zip(pairs, ids):
        kind, _, origin = pair_id.partition(":")
        assert kind == pair["kind"].decode()
        path, _, name = origin.partition(":")
        assert path.endswith(".py") and not path.startswith("/")
        if kind == "module":
            assert name == ""
    # A method's docstring is named by its module and class; a module pair by its module.
    assert "docstring:textwrap.py:TextWrapper.wrap" in ids and "module:json/__init__.py" in ids


@pytest.mark.slow
def test_embedded_vocabulary_round_trips_text_with_newlines(vocab):
    for text in (NEWLINE_TEXT, UNICODE_TEXT):
        ids = vocab.encode(text)
        assert vocab.decode(ids) == text
    newline_ids = vocab.encode(NEWLINE_TEXT)
    assert [vocab.tokenizer.id_to_piece(i) for i in newline_ids].count("\n") == 1
    assert vocab.decode_tf(vocab.encode_tf(NEWLINE_TEXT)).numpy().decode() == NEWLINE_TEXT
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    trained = spm.SentencePieceProcessor(model_file=vocab.sentencepiece_model_file).get_piece_size()
    assert trained == vocabularies.DEFAULT_EMBEDDED_VOCAB_SIZE
    assert vocab.vocab_size == trained + 100
    assert vocab.encode("<extra_id_0>") == [vocab.vocab_size - 1]
    # A vocabulary that earns its keep compresses English well beyond one byte per token.
    sample = "Return the value of the attribute, or raise an exception if it is missing."
    assert len(vocab.encode(sample)) < len(sample.encode("utf-8")) / 2.5


@pytest.mark.slow
def test_vocabulary_is_cached_and_reused(vocab, cache_root, monkeypatch):
    path = vocabularies.embedded_vocabulary_path(cache_dir=cache_root)
    assert vocab.sentencepiece_model_file == path
    mtime = os.stat(path).st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("retrained a cached vocabulary")

    monkeypatch.setattr(vocabularies, "train_sentencepiece", fail)
    again = vocabularies.embedded_vocabulary(cache_dir=cache_root)
    assert os.stat(path).st_mtime_ns == mtime
    assert again.encode(NEWLINE_TEXT) == vocab.encode(NEWLINE_TEXT)


def test_concurrent_builders_of_the_corpus_build_it_once(tmp_path, monkeypatch):
    # Several processes (test workers, jobs) asking for the corpus at once: one builds, the
    # others wait for its lock and read its copy. Threads hold separate lock descriptors too.
    builds = []

    def slow_build(target):
        builds.append(target)
        time.sleep(0.3)
        os.makedirs(target)
        with open(os.path.join(target, embedded.MANIFEST), "w") as f:
            f.write("{}")

    monkeypatch.setattr(embedded, "_build_into", slow_build)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: embedded.build_corpus(cache_dir=str(tmp_path)), range(3)))
    assert len(builds) == 1 and built == [builds[0]] * 3


def test_missing_sentencepiece_model_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "spm.model"
    with pytest.raises(DataNotFoundError, match=re.escape(str(missing))) as info:
        vocabularies.sentencepiece_vocabulary(str(missing))
    assert "terra-vocab" in str(info.value)
    assert vocabularies.byte_vocabulary().decode(vocabularies.byte_vocabulary().encode(UNICODE_TEXT)) == UNICODE_TEXT


def test_train_vocab_cli_writes_a_model(tmp_path, capsys):
    corpus = tmp_path / "docs.txt"
    paragraphs = [
        f"Document {i} talks about sparse layers.\nIts second line mentions decoding speed {i}." for i in range(50)
    ]
    corpus.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    out = tmp_path / "vocab" / "small.model"
    argv = ["--input", str(corpus), "--out", str(out), "--vocab_size", "400", "--nohard_vocab_limit"]
    assert vocab_cli.main(argv) == 0
    assert out.is_file() and out.with_suffix(".vocab").is_file()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []
    printed = capsys.readouterr().out
    assert str(out) in printed and "round trip ok" in printed
    vocab = vocabularies.sentencepiece_vocabulary(str(out))
    assert vocab.decode(vocab.encode(paragraphs[3])) == paragraphs[3]
    assert vocab.tokenizer.piece_to_id("\n") == 3


def test_train_vocab_cli_reports_a_missing_input_without_a_traceback(tmp_path, capsys):
    missing = tmp_path / "absent.txt"
    assert vocab_cli.main(["--input", str(missing), "--out", str(tmp_path / "x.model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "Traceback" not in err


def _write_paragraphs(path, n=50):
    paragraphs = [f"Paragraph {i} is about sparse layers.\nIts second line is about decoding {i}." for i in range(n)]
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return paragraphs


def _run_vocab_command(form, args, *, cache_dir, monkeypatch, capsys):
    """``terra-vocab ARGS`` as a console command, in a process of its own (the entry point
    setup.cfg installs), or ``python -m terra.cli.vocab ARGS`` in this process (runpy runs the
    module as ``__main__``, as ``python -m`` does): its exit status, standard output and error."""
    if form == "console":
        result = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "terra-vocab"), *args],
            cwd=REPO_ROOT,
            env={**os.environ, "TERRA_CACHE_DIR": cache_dir},
            capture_output=True,
            text=True,
            timeout=300,
        )
        return result.returncode, result.stdout, result.stderr
    with monkeypatch.context() as patch:
        patch.chdir(REPO_ROOT)
        patch.setenv("TERRA_CACHE_DIR", cache_dir)
        patch.setenv(process_memory.NO_RESTART_VARIABLE, "1")  # no restart: this process is pytest
        # A failed command ends its process at once (os._exit): here it raises SystemExit instead.
        patch.setattr(app, "_leave", sys.exit)
        patch.setattr(sys, "argv", [vocab_cli.__file__, *args])
        capsys.readouterr()
        with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
            warnings.filterwarnings("ignore", "'terra.cli.vocab' found in sys.modules", RuntimeWarning)
            runpy.run_module("terra.cli.vocab", run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("form", [pytest.param("console", marks=pytest.mark.slow), "module"])
def test_train_vocab_runs_as_a_console_command_and_as_a_module(form, tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "docs.txt"
    paragraphs = _write_paragraphs(corpus)
    out = tmp_path / "v.model"
    run = functools.partial(
        _run_vocab_command, form, cache_dir=str(tmp_path / "cache"), monkeypatch=monkeypatch, capsys=capsys
    )
    status, stdout, stderr = run(
        ["--input", str(corpus), "--out", str(out), "--vocab_size", "300", "--nohard_vocab_limit"]
    )
    assert status == 0, stderr
    assert f"wrote {out}" in stdout and "round trip ok" in stdout
    vocab = vocabularies.sentencepiece_vocabulary(str(out))
    assert vocab.decode(vocab.encode(paragraphs[7])) == paragraphs[7]
    status, _, stderr = run(["--input", str(tmp_path / "absent.txt"), "--out", str(out)])
    assert status == 2 and "error: input file not found" in stderr
    assert "Traceback" not in stderr


def test_the_vocabulary_library_has_no_command_line_and_no_task_import():
    with open(vocabularies.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "argparse" not in imported and "sys" not in imported
    assert not any(name.startswith("terra.data.tasks") or name == "terra.data.tasks" for name in imported), imported
    assert imported & {"terra.data.embedded"}
    for name in ("main", "build_arg_parser", "task_texts", "read_documents"):
        assert not hasattr(vocabularies, name), name
    for name in ("main", "build_arg_parser"):  # the command line lives in terra.cli.vocab
        assert not hasattr(vocabulary_training, name), name


def test_task_texts_reads_the_raw_text_of_a_task(tmp_path):
    from terra.data import fixtures
    from terra.gin_config import parsing

    docs = [f"Document {i} is about sparse layers.\nSecond line {i}." for i in range(6)]
    fixtures.write_c4_json(str(tmp_path), {"train": docs, "validation": docs[:2]}, shards=2)
    parsing.parse_gin([], [f"terra.data.c4_source.json_path = {str(tmp_path)!r}"])
    texts = vocabulary_training.task_texts("c4_span_corruption", max_documents=100)
    assert sorted(texts) == sorted(docs)
    assert vocabulary_training.task_texts("c4_span_corruption", max_documents=100) == texts  # fixed order
    assert len(vocabulary_training.task_texts("c4_span_corruption", split="validation", max_documents=1)) == 1


def test_read_documents_splits_blocks_or_lines(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one\ntwo\n\n  \nthree\r\n", encoding="utf-8")
    assert vocabulary_training.read_documents(str(path)) == ["one\ntwo", "three"]
    assert vocabulary_training.read_documents(str(path), documents="lines") == ["one", "two", "three"]


def test_a_cache_that_cannot_be_written_names_terra_cache_dir(tmp_path, monkeypatch):
    from terra.errors import StorageError

    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    with pytest.raises(StorageError) as error:
        embedded.build_corpus(cache_dir=str(in_the_way / "cache"))
    message = str(error.value)
    assert message.startswith(f"cannot write terra's cache {in_the_way}/cache (Not a directory")
    assert "set TERRA_CACHE_DIR to a writable folder" in message

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / "home"))

    monkeypatch.setattr(embedded.os, "makedirs", read_only)
    with pytest.raises(StorageError, match="Read-only file system: .*set TERRA_CACHE_DIR to a writable folder"):
        embedded.build_corpus(cache_dir=str(tmp_path / "home" / ".cache" / "terra"))
    assert not (tmp_path / "home").exists()
