"""JSON-lines files read in ``tf.data``, checked record by record (C4 shards, Cohan arXiv files).

What a damaged or unexpected file does (``docs/data.md``, "Damaged and unexpected files"):

* **Fatal, naming the file and line:** a line that is not JSON, or not a JSON object; a gzip
  file that is truncated or not gzip at all; a split whose files hold no usable record. The
  stream stops with an :class:`~terra.errors.InputError`; a run started on it exits with
  status 2 before or at its first step, and the checkpoints already written stay intact.
* **Skipped and counted:** a well-formed record without the required text (``text`` for C4,
  ``article_text``/``abstract_text`` for arXiv), or with only whitespace. The first skip of
  each kind in each file is logged with its line; :func:`skip_report` gives the counts, which
  the trainer, ``terra-evaluate`` and ``terra-data show`` print at the end.
* **Never a hang:** :data:`MAX_CONSECUTIVE_SKIPS` skipped records in a row, with no usable one
  between them, stop the stream with an error naming the file and the lines (a training
  stream repeats forever, so files that hold nothing usable would otherwise spin).

The parse runs in ``tf.py_function`` (TF has no JSON op), so an exception raised there reaches
the reader wrapped in a ``tf.errors.OpError`` with TF's own traceback. The reader therefore
keeps the error it raised and :func:`checked` (and :class:`terra.data.pipeline.BatchIterator`)
re-raise that one. Errors from TF's own file readers (gzip) do not say which file failed:
:func:`diagnose` finds it by reading the candidate files again in Python.
"""

import collections
import gzip
import json
import logging
import os
import stat
import threading
import time
import weakref
import zlib
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import tensorflow as tf

from terra.errors import InputError

MAX_CONSECUTIVE_SKIPS = 10_000
GZIP_MAGIC = b"\x1f\x8b"
# Formats people download that TF cannot decompress: say how to convert instead of failing deep.
UNSUPPORTED_COMPRESSION = {".zst": "zstd -d", ".bz2": "bunzip2", ".xz": "unxz", ".lz4": "lz4 -d"}
JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
DIAGNOSE_SECONDS = 120.0


class SkipRecord(Exception):
    """A well-formed record without the content the source needs; the message is the reason."""


def is_gzip_name(path: str) -> bool:
    return path.endswith(".gz")


def check_files(paths: Sequence[str], description: str) -> None:
    """Fail now, naming the file, on what can be seen without reading whole files: a path that
    is not a regular file (a FIFO would block the reader forever, a symlink loop fails deep in
    TensorFlow), a compression TF cannot read, or a ``.gz`` file that does not start as gzip."""
    for path in paths:
        _check_regular_file(path, description)
        for suffix, command in UNSUPPORTED_COMPRESSION.items():
            if path.endswith(suffix):
                raise InputError(
                    f"{description}: {path} is {suffix[1:]}-compressed, which TensorFlow cannot read; "
                    f"decompress it (`{command} {path}`) or recompress it with gzip."
                )
        if is_gzip_name(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:
                head = f.read(2)
            if head != GZIP_MAGIC:
                raise InputError(
                    f"{description}: {path} is named .gz but is not gzip (it starts with bytes {head!r}); "
                    "rename it without .gz if it is plain JSON lines, or download it again."
                )


def _check_regular_file(path: str, description: str) -> None:
    if "://" in path:  # a remote file system's objects are files
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise InputError(f"{description}: cannot open {path}: {e.strerror}; remove it or fix the link.") from None
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise InputError(f"{description}: {path} is {kind}, not a data file; move it out of the data folder.")


class JsonLinesReader:
    """``read_file(filename) -> tf.data.Dataset`` of string features, one example per usable line.

    Args:
      description: how errors name the data, e.g. ``"C4 JSON under /data/c4"``.
      features: the names of the string features ``to_features`` returns, in order.
      to_features: one decoded JSON object -> its feature values; raises :class:`SkipRecord`
        for a record without the needed content.
      max_consecutive_skips: skipped records in a row that stop the stream.
    """

    def __init__(
        self,
        description: str,
        features: Sequence[str],
        to_features: Callable[[dict], Sequence[str]],
        *,
        max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
    ):
        self.description = description
        self.features = tuple(features)
        self.to_features = to_features
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped: collections.Counter = collections.Counter()
        self.used = 0
        self.errors: List[InputError] = []  # tf.data's parallel map may raise any of them
        self._consecutive_skips = 0
        self._first_skip: Optional[str] = None
        self._logged = set()
        self._last_read: Dict[str, float] = {}
        self._lock = threading.Lock()
        _READERS.add(self)

    def read_file(self, filename: tf.Tensor) -> tf.data.Dataset:
        compression = tf.where(tf.strings.regex_full_match(filename, r".*\.gz"), "GZIP", "")
        lines = tf.data.TextLineDataset(filename, compression_type=compression).enumerate(start=1)
        parsed = lines.map(lambda number, line: self._parse_in_graph(filename, number, line))
        return parsed.filter(lambda example: example["usable"]).map(
            lambda example: {k: v for k, v in example.items() if k != "usable"}
        )

    def _parse_in_graph(self, filename, number, line) -> dict:
        outputs = tf.py_function(self._parse, [filename, number, line], [tf.bool] + [tf.string] * len(self.features))
        example = {"usable": tf.ensure_shape(outputs[0], [])}
        example.update({k: tf.ensure_shape(v, []) for k, v in zip(self.features, outputs[1:])})
        return example

    def _parse(self, filename, number, line) -> list:
        path, number = filename.numpy().decode(), int(number.numpy())
        with self._lock:
            self._last_read[path] = time.monotonic()
        try:
            values = self.to_features(self._decode(path, number, line.numpy()))
        except SkipRecord as skip:
            self._count_skip(path, number, str(skip))
            return [False] + [""] * len(self.features)
        with self._lock:
            self.used += 1
            self._consecutive_skips = 0
        return [True] + list(values)

    def _decode(self, path: str, number: int, raw: bytes) -> dict:
        where = f"{self.description}: {path}, line {number}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # TF's gzip reader hands over a truncated file's last partial line without complaint.
            damage = _file_problem(path) if is_gzip_name(path) else None
            if damage:
                raise self._fail(f"{self.description}: {path}: {damage}") from None
            reason = getattr(e, "msg", None) or str(e)
            raise self._fail(f"{where}: not valid JSON ({reason}); the file is damaged or not JSON lines.") from None
        if not isinstance(record, dict):
            raise self._fail(f"{where}: a JSON {type(record).__name__}, not an object (one record per line).")
        return record

    def _count_skip(self, path: str, number: int, reason: str) -> None:
        with self._lock:
            self.skipped[reason] += 1
            self._consecutive_skips += 1
            if self._consecutive_skips == 1:
                self._first_skip = f"{path}, line {number}"
            first_of_kind = (path, reason) not in self._logged
            self._logged.add((path, reason))
            stuck = self._consecutive_skips >= self.max_consecutive_skips
        if first_of_kind:
            logging.warning(
                "%s: skipping %s, line %d: %s (further skips are counted).", self.description, path, number, reason
            )
        if stuck:
            raise self._fail(
                f"{self.description}: {self.max_consecutive_skips} records in a row were skipped, the last at "
                f"{path}, line {number}, the first at {self._first_skip} (reasons: {self._reasons()}); "
                "these files hold no usable records. Check that they are the right dataset."
            )

    def _reasons(self) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())

    def _fail(self, message: str) -> InputError:
        error = InputError(message)
        with self._lock:
            self.errors.append(error)
        return error

    def raised_errors(self) -> List[InputError]:
        """Every error this reader raised, in order (parallel parses can fail together)."""
        with self._lock:
            return list(self.errors)

    def summary(self) -> Optional[str]:
        """``"<description>: skipped N records (reasons)"``, or None when nothing was skipped."""
        if not self.skipped:
            return None
        skipped = sum(self.skipped.values())
        return f"{self.description}: used {self.used} records, skipped {skipped} ({self._reasons()})."

    def recently_read(self) -> List[str]:
        """Files this reader has parsed lines of, the most recent first."""
        with self._lock:
            return sorted(self._last_read, key=self._last_read.get, reverse=True)


_READERS: "weakref.WeakSet[JsonLinesReader]" = weakref.WeakSet()


def _readers(readers: Optional[Sequence[JsonLinesReader]]) -> List[JsonLinesReader]:
    return list(_READERS) if readers is None else list(readers)


def skip_report(readers: Optional[Sequence[JsonLinesReader]] = None) -> List[str]:
    """One line per reader (default: every live one) that skipped records."""
    return [line for line in (reader.summary() for reader in _readers(readers)) if line]


def _raised_error(error: tf.errors.OpError, readers: Optional[Sequence[JsonLinesReader]]) -> Optional[InputError]:
    """The reader's own error that ``error`` wraps (TF's message quotes it)."""
    for reader in _readers(readers):
        for candidate in reader.raised_errors():  # parallel parses fail at once: the one TensorFlow raised
            if str(candidate) in error.message:
                return candidate
    return None


def first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), message)


def diagnose(paths: Iterable[str], *, seconds: float = DIAGNOSE_SECONDS) -> Optional[str]:
    """Read each file in Python (the order given) until one fails to decompress or decode;
    ``"<path>: <what is wrong>"``, or None when none does within ``seconds``."""
    deadline = time.monotonic() + seconds
    for path in paths:
        if time.monotonic() > deadline:
            return None
        problem = _file_problem(path)
        if problem:
            return f"{path}: {problem}"
    return None


def open_binary(path: str):
    """A JSON-lines file's bytes, gunzipped when its name ends in ``.gz``."""
    return gzip.open(path, "rb") if is_gzip_name(path) else open(path, "rb")


def count_records(paths: Sequence[str], description: str) -> int:
    """The non-blank lines (records, before any is skipped) of ``paths``: reads them all. A file
    that is not a regular file or is damaged is an :class:`InputError` naming it."""
    check_files(paths, description)
    count = 0
    for path in paths:
        try:
            with open_binary(path) as f:
                count += sum(1 for line in f if line.strip())
        except (EOFError, OSError, zlib.error):
            raise InputError(f"{description}: {path}: {_file_problem(path) or 'cannot be read.'}") from None
    return count


def _file_problem(path: str) -> Optional[str]:
    lines = 0
    try:
        with open_binary(path) as f:
            for raw in f:
                raw.decode("utf-8")
                lines += 1
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        return f"the gzip stream is damaged after line {lines} ({e}); download the file again."
    except UnicodeDecodeError as e:
        return f"line {lines + 1} is not UTF-8 ({e.reason}); the file is damaged."
    except OSError as e:
        return f"cannot be read ({e})."
    return None


def as_input_error(
    error: tf.errors.OpError, *, files: Sequence[str] = (), readers: Optional[Sequence[JsonLinesReader]] = None
) -> InputError:
    """The :class:`InputError` behind a ``tf.data`` failure: the one one of ``readers`` (default:
    every live one) raised, else a message naming the damaged file among those the readers were
    reading and ``files``."""
    raised = _raised_error(error, readers)
    if raised is not None:
        return raised
    candidates = [p for reader in _readers(readers) for p in reader.recently_read()]
    candidates += [p for p in files if p not in candidates]
    found = diagnose(candidates)
    cause = first_line(error.message)
    if found:
        return InputError(f"reading the input data failed: {found} (TensorFlow said: {cause})")
    return InputError(
        f"reading the input data failed: {cause}. No damaged file was found among "
        f"{len(candidates)} candidate JSON files; for a prepared TFDS dataset, prepare it again."
    )


def checked(
    iterator: Iterator, *, files: Sequence[str] = (), readers: Optional[Sequence[JsonLinesReader]] = None
) -> Iterator:
    """``iterator`` (over a ``tf.data`` dataset) with read failures turned into one
    :class:`InputError` (see :func:`as_input_error`)."""
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except tf.errors.OpError as e:
            raise as_input_error(e, files=files, readers=readers) from None
        yield item
