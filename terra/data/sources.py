"""Where text comes from: read-only TFDS directories and local JSON-lines files, never the network.

Users pretrain on C4 and fine-tune on arXiv (paper §4.4, appendix 6.5–6.6) with data they
already have. Two real code paths per dataset (``docs/design/data_pipeline.md``, "Rules terra follows"):

* a prepared TFDS directory, read through ``seqio.TfdsDataSource(..., read_only=True)``:
  ``c4/en:3.1.0`` (the newest version the pinned TFDS can construct; a directory prepared by
  another TFDS version, e.g. AllenAI's ``3.0.1`` copy, is read from its ``dataset_info.json``)
  and ``scientific_papers/arxiv:1.1.1``;
* the files people actually download: allenai/c4's ``c4-{train,validation}.*.json.gz`` shards
  and the extracted Cohan et al. ``arxiv-dataset/{train,val,test}.txt`` JSON lines, which
  yield exactly the TFDS features (``article``/``abstract`` joined with newlines, ``<S>`` tags
  removed, one sentence per line).

Both arXiv paths also give each paper a stable string ``id`` for evaluation output: the Cohan
files' ``article_id``, or TFDS's record id for the prepared directory (whose builder keeps no id).

Every source checks its data before anything is built (:func:`check_available`), so a missing
or unprepared dataset fails in well under a second with the path it tried and how to get the
data. ``read_only=True`` matters: without it seqio asks TFDS to download and prepare, which for
arXiv retries Google Drive for minutes before failing.
"""

import os
import re
import zipfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import seqio
import tensorflow as tf

from terra.data import json_lines
from terra.documents import cohan_example, cohan_field_problem
from terra.errors import DataNotFoundError, InputError

C4_TFDS_VERSION = "3.1.0"
ARXIV_TFDS_NAME = "scientific_papers/arxiv:1.1.1"

C4_HOW_TO_GET = (
    "C4 cannot be prepared on one machine (TFDS builds it with Apache Beam over Common Crawl). "
    "Either copy a prepared TFDS copy into this directory, e.g. AllenAI's "
    "`gsutil -u <project> -m cp 'gs://allennlp-tensorflow-datasets/c4/en/3.0.1/*' <data_dir>/c4/en/3.0.1` "
    "(then bind terra.data.c4_source.version = '3.0.1'), or download the JSON shards "
    "(`git clone https://huggingface.co/datasets/allenai/c4` with `GIT_LFS_SKIP_SMUDGE=1`, then "
    "`git lfs pull --include 'en/*'`) and point the C4 tasks at them with --c4_json=<dir> "
    "(gin: c4_source.json_path = '<dir>')."
)
ARXIV_HOW_TO_GET = (
    "Download arxiv-dataset.zip (3.6 GB; the Google Drive link or archive.org mirror in the README "
    "of github.com/armancohan/long-summarization), put it in <data_dir>/downloads/manual/ and run "
    "`terra-data prepare-arxiv --data_dir <data_dir>` (offline, about 15 GB "
    "of disk), or unzip it and point arxiv_summarization at the extracted train.txt/val.txt/test.txt with "
    "--arxiv_cohan=<dir> (gin: arxiv_source.cohan_path = '<dir>')."
)


def default_tfds_data_dir() -> str:
    """TFDS's own convention: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
    return os.path.expanduser(os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")


def _tfds_path(data_dir: str, name: str) -> str:
    """``c4/en:3.1.0`` -> ``<data_dir>/c4/en/3.1.0``: the directory TFDS reads."""
    base, _, version = name.partition(":")
    return os.path.join(data_dir, *base.split("/"), version)


class ReadOnlyTfdsSource(seqio.TfdsDataSource):
    """A ``seqio.TfdsDataSource`` that only ever reads a prepared directory and says what to do
    when it is not there (seqio's own message suggests a download).

    With ``add_ids=True`` every example also has a string feature ``id``: TFDS's own record id
    (``tfds.ReadConfig(add_tfds_id=True)``), ``<prepared file name>__<index in the file>``, e.g.
    ``b"scientific_papers-test.tfrecord-00000-of-00001__3"``. It names the record in the prepared
    directory, so it is the same however the files are shuffled or sharded across hosts, for
    datasets like ``scientific_papers`` that store no id of their own.
    """

    def __init__(
        self, name: str, *, data_dir: Optional[str] = None, how_to_get: str = "", splits=None, add_ids: bool = False
    ):
        self.name_with_version = name
        self.data_dir = os.path.expanduser(data_dir) if data_dir else default_tfds_data_dir()
        self.how_to_get = how_to_get
        self.add_ids = add_ids
        # seqio keeps only the canonical split names; reading with ids needs the TFDS split too.
        self.split_map = dict(splits) if isinstance(splits, Mapping) else {}
        super().__init__(tfds_name=name, tfds_data_dir=self.data_dir, splits=splits, read_only=True)

    @property
    def expected_path(self) -> str:
        return _tfds_path(self.data_dir, self.name_with_version)

    def check_available(self, split: Optional[str] = None) -> None:
        import tensorflow_datasets as tfds

        path = self.expected_path
        try:
            prepared = tfds.builder(self.name_with_version, data_dir=self.data_dir).is_prepared()
        except Exception as e:  # unknown version, unreadable metadata, ...
            raise DataNotFoundError(
                f"TFDS dataset {self.name_with_version} could not be opened at {path}: {e}. {self.how_to_get}"
            ) from None
        if not prepared:
            raise DataNotFoundError(
                f"TFDS dataset {self.name_with_version} is not prepared: nothing readable at {path} "
                f"(data_dir={self.data_dir}; set it with --tfds_data_dir or $TFDS_DATA_DIR). {self.how_to_get}"
            )
        if split is not None and split not in self.splits:
            raise DataNotFoundError(
                f"TFDS dataset {self.name_with_version} at {path} has no split '{split}'; it has {sorted(self.splits)}."
            )

    def get_dataset(self, split=None, shuffle=True, seed=None, shard_info=None, **kwargs):
        self.check_available(split)
        if not self.add_ids:
            return super().get_dataset(split, shuffle, seed, shard_info, **kwargs)
        return self._read_with_ids(split or "train", shuffle, seed, shard_info)

    def _read_with_ids(self, split: str, shuffle: bool, seed: Optional[int], shard_info) -> tf.data.Dataset:
        """What seqio's read-only TFDS load does (same file shuffling, seed and per-host
        input context), with TFDS's record ids added and renamed to ``id``."""
        import tensorflow_datasets as tfds

        read_config = tfds.ReadConfig(
            add_tfds_id=True,
            shuffle_seed=seed,
            skip_prefetch=True,
            input_context=(
                tf.distribute.InputContext(
                    num_input_pipelines=shard_info.num_shards, input_pipeline_id=shard_info.index
                )
                if shard_info
                else None
            ),
        )
        ds = self.tfds_dataset.builder.as_dataset(
            split=self.split_map.get(split, split), shuffle_files=shuffle, read_config=read_config
        )

        def rename(features):
            features = dict(features)
            features["id"] = features.pop("tfds_id")
            return features

        return ds.map(rename, num_parallel_calls=tf.data.AUTOTUNE)


class LocalFileSource(seqio.FileDataSource):
    """A ``seqio.FileDataSource`` over explicit lists of local JSON-lines files, read and checked
    record by record by a :class:`~terra.data.json_lines.JsonLinesReader`. (A seqio Task shards
    by example when a split has fewer files than hosts, e.g. the single Cohan file per split.)

    Args:
      reader: parses each file's lines into examples.
      split_files: split -> its files (an empty list: the split is not available).
      missing_hint: split -> what to do when that split has no files (default ``how_to_get``).
    """

    def __init__(
        self,
        reader: json_lines.JsonLinesReader,
        split_files: Mapping[str, Sequence[str]],
        *,
        tried: Mapping[str, str],
        description: str,
        how_to_get: str,
        missing_hint: Optional[Mapping[str, str]] = None,
    ):
        self.reader = reader
        self.description = description
        self.how_to_get = how_to_get
        self.tried = dict(tried)
        self.missing_hint = dict(missing_hint or {})
        self._files = {split: sorted(files) for split, files in split_files.items()}
        super().__init__(read_file_fn=reader.read_file, split_to_filepattern=self._files)

    def list_shards(self, split: str) -> Sequence[str]:
        return self._files.get(split, [])

    def check_available(self, split: Optional[str] = None) -> None:
        splits = [split] if split is not None else list(self.splits)
        for s in splits:
            if s not in self._files:
                raise DataNotFoundError(f"{self.description} has no split '{s}'; it has {sorted(self.splits)}.")
            if not self._files[s]:
                raise DataNotFoundError(
                    f"{self.description}: no file for split '{s}' (looked for {self.tried[s]}). "
                    f"{self.missing_hint.get(s, self.how_to_get)}"
                )
            json_lines.check_files(self._files[s], self.description)

    def get_dataset(self, split="train", shuffle=True, seed=None, shard_info=None, **kwargs):
        self.check_available(split)
        return super().get_dataset(split, shuffle, seed, shard_info, **kwargs)

    def count_lines(self, split: str) -> int:
        """The records (non-blank lines) in ``split``'s files: reads them all."""
        return json_lines.count_records(self.list_shards(split), self.description)


def split_inventory(
    source: seqio.DataSource, *, count_records: bool = True
) -> List[Tuple[str, Optional[int], Optional[int]]]:
    """``(split, files, records)`` for each split ``source`` has (None where it cannot say: a
    generated split has no files). Local JSON files are counted line by line (``count_records``:
    that reads every file); TFDS reads its counts from the dataset's metadata."""
    rows = []
    for split in sorted(source.splits):
        files = records = None
        if isinstance(source, LocalFileSource):
            files = len(source.list_shards(split))
            records = source.count_lines(split) if count_records else None
        elif isinstance(source, seqio.TfdsDataSource):
            info = source.tfds_dataset.info.splits[split]
            files, records = info.num_shards, info.num_examples
        rows.append((split, files, records))
    return rows


def check_available(source: seqio.DataSource, split: Optional[str] = None) -> None:
    """Raise :class:`DataNotFoundError` now if ``source`` cannot deliver ``split``."""
    check = getattr(source, "check_available", None)
    if check is not None:
        check(split)


# --- C4 ---------------------------------------------------------------------------------------


def c4_tfds_source(
    *, data_dir: Optional[str] = None, version: str = C4_TFDS_VERSION, config: str = "en"
) -> ReadOnlyTfdsSource:
    """C4 from a prepared TFDS directory (``<data_dir>/c4/<config>/<version>``); field ``text``."""
    return ReadOnlyTfdsSource(f"c4/{config}:{version}", data_dir=data_dir, how_to_get=C4_HOW_TO_GET)


_GLOB_CHARACTERS = ("*", "?", "[")
# A file whose path (below the folder given) has one of these words is validation data.
_VALIDATION_WORD = re.compile(r"(?<![a-z])(validation|valid|val|dev)(?![a-z])", re.IGNORECASE)
_ALLENAI_NAME = re.compile(r"^c4-(train|validation)\.")


# Found so that check_files can say how to decompress them, rather than ignored.
_COMPRESSED = tuple(s + c for s in (".json", ".jsonl") for c in json_lines.UNSUPPORTED_COMPRESSION)


def _glob(pattern: str) -> List[str]:
    return sorted(p for p in tf.io.gfile.glob(pattern) if not tf.io.gfile.isdir(p))


def _json_files_below(folder: str) -> List[str]:
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.join(root, n) for n in names if n.endswith(json_lines.JSON_SUFFIXES + _COMPRESSED)]
    return sorted(found)


def _expand(path: Union[str, Sequence[str]]) -> List[str]:
    """A file, a glob or a list of them -> the files (a folder is :func:`c4_json_files`'s job)."""
    if not isinstance(path, str):
        return sorted({f for item in path for f in _expand(item)})
    path = os.path.expanduser(path)
    if any(c in path for c in _GLOB_CHARACTERS):
        return _glob(path)
    if os.path.isdir(path):
        return _json_files_below(path)
    return [path] if os.path.exists(path) else []


def c4_json_files(
    path: Union[str, Sequence[str]], validation_path: Union[str, Sequence[str], None] = None
) -> Dict[str, List[str]]:
    """``{"train": [...], "validation": [...]}``: the JSON-lines files (``.json``, ``.jsonl``,
    either gzipped) that ``path`` names, with any shard names (allenai/c4, OLMo, Dolma):

    * a folder (an allenai/c4 clone's root, whose ``en/`` is used, or any folder of shards,
      searched recursively): files named ``c4-train.*``/``c4-validation.*`` by those names;
      every other file is validation data when its path below the folder has the word
      ``validation``, ``valid``, ``val`` or ``dev``, and training data else (a folder mixing
      allenai shards with others reads them all: no file is left out);
    * a pattern with ``{split}``, e.g. ``/data/c4/en/c4-{split}.000*-of-*.json.gz``;
    * a glob, a file, or a list of them: all training data.

    ``validation_path`` (same forms) names the validation files explicitly.
    """
    if isinstance(path, str) and "{split}" in path:
        files = {s: _glob(os.path.expanduser(path.format(split=s))) for s in ("train", "validation")}
    elif isinstance(path, str) and os.path.isdir(os.path.expanduser(path)):
        folder = os.path.expanduser(path)
        folder = os.path.join(folder, "en") if os.path.isdir(os.path.join(folder, "en")) else folder
        found = _json_files_below(folder)
        files = {"train": [], "validation": []}
        for f in found:
            allenai = _ALLENAI_NAME.match(os.path.basename(f))
            if allenai:
                files[allenai.group(1)].append(f)
            else:
                files["validation" if _VALIDATION_WORD.search(os.path.relpath(f, folder)) else "train"].append(f)
    else:
        files = {"train": _expand(path), "validation": []}
    if validation_path is not None:
        files["validation"] = _expand(validation_path)
    return files


def _c4_features(record: dict) -> Tuple[str, str, str]:
    text = record.get("text")
    if text is None:
        raise json_lines.SkipRecord("no 'text' field")
    if not isinstance(text, str):
        raise json_lines.SkipRecord(f"'text' is a {type(text).__name__}, not a string")
    if not text.strip():
        raise json_lines.SkipRecord("empty 'text'")
    return text, str(record.get("url") or ""), str(record.get("timestamp") or "")


def _looked_for(path: Union[str, Sequence[str]], split: str) -> str:
    """What :func:`c4_json_files` searched for ``split``, for the error when it found nothing."""
    if not isinstance(path, str):
        return f"{len(path)} listed files"
    if "{split}" in path:
        return path.format(split=split)
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return f"c4-{split}.* or *.json[l][.gz] files below {expanded}"
    if any(c in path for c in _GLOB_CHARACTERS) or os.path.exists(expanded):
        return path
    return f"{path}: no such file or folder"


def c4_json_source(
    *, path: Union[str, Sequence[str]], validation_path: Union[str, Sequence[str], None] = None
) -> LocalFileSource:
    """C4-style JSON-lines documents (field ``text``; ``url`` and ``timestamp`` kept when
    present, every other field ignored) from the files :func:`c4_json_files` finds. A record
    without text is skipped and counted; a damaged file is an error naming it and the line
    (``terra/data/json_lines.py``)."""
    description = f"C4 JSON under {path if isinstance(path, str) else f'{len(path)} listed files'}"
    tried = {"train": _looked_for(path, "train"), "validation": _looked_for(validation_path or path, "validation")}
    return LocalFileSource(
        json_lines.JsonLinesReader(description, ("text", "url", "timestamp"), _c4_features),
        c4_json_files(path, validation_path),
        tried=tried,
        description=description,
        how_to_get=C4_HOW_TO_GET,
        missing_hint={
            "validation": "Name the validation files with --c4_validation_json=PATH (gin: "
            "c4_source.validation_json_path), or give a folder whose validation files have 'validation' or 'val' "
            "in their names, or a pattern with {split}."
        },
    )


# --- arXiv ------------------------------------------------------------------------------------


def arxiv_tfds_source(*, data_dir: Optional[str] = None) -> ReadOnlyTfdsSource:
    """arXiv from a prepared TFDS ``scientific_papers/arxiv:1.1.1`` directory; fields
    ``article``, ``abstract`` (one sentence per line), ``section_names`` and ``id``. The TFDS
    builder does not keep the papers' ``article_id``, so ``id`` is TFDS's record id (see
    :class:`ReadOnlyTfdsSource`)."""
    return ReadOnlyTfdsSource(ARXIV_TFDS_NAME, data_dir=data_dir, how_to_get=ARXIV_HOW_TO_GET, add_ids=True)


COHAN_FEATURES = ("article", "abstract", "section_names", "id")


def _cohan_features(record: dict) -> List[str]:
    for field in ("article_text", "abstract_text"):
        problem = cohan_field_problem(record, field)
        if problem:  # skipped and counted, its file and line logged (json_lines.JsonLinesReader)
            raise json_lines.SkipRecord(problem)
    example = cohan_example(record)
    for feature, field in (("article", "article_text"), ("abstract", "abstract_text")):
        if not example[feature].strip():
            raise json_lines.SkipRecord(f"empty '{field}'")
    return [example[k] for k in COHAN_FEATURES]


COHAN_SPLIT_FILES = {"train": "train.txt", "validation": "val.txt", "test": "test.txt"}


def arxiv_cohan_source(*, path: str) -> LocalFileSource:
    """The extracted ``arxiv-dataset/{train,val,test}.txt`` (JSON lines, one paper each), given
    that folder or its parent; features as :func:`cohan_example`. A paper without article or
    abstract sentences is skipped and counted; a damaged line is an error naming it."""
    folder = os.path.expanduser(path)
    if os.path.isdir(os.path.join(folder, "arxiv-dataset")):
        folder = os.path.join(folder, "arxiv-dataset")
    description = f"arXiv (Cohan JSON lines) under {folder}"
    tried = {split: os.path.join(folder, name) for split, name in COHAN_SPLIT_FILES.items()}
    return LocalFileSource(
        json_lines.JsonLinesReader(description, COHAN_FEATURES, _cohan_features),
        {split: [f] if os.path.exists(f) else [] for split, f in tried.items()},
        tried=tried,
        description=description,
        how_to_get=ARXIV_HOW_TO_GET,
    )


def prepare_arxiv(data_dir: str, *, manual_dir: Optional[str] = None) -> str:
    """Build TFDS ``scientific_papers/arxiv:1.1.1`` offline from ``arxiv-dataset.zip`` in the
    manual directory (TFDS verifies its checksum). Refuses to start without the zip, so TFDS
    never falls back to downloading it."""
    import tensorflow_datasets as tfds

    data_dir = os.path.expanduser(data_dir)
    manual_dir = os.path.expanduser(manual_dir or os.path.join(data_dir, "downloads", "manual"))
    zip_path = os.path.join(manual_dir, "arxiv-dataset.zip")
    if not os.path.exists(zip_path):
        raise DataNotFoundError(f"{zip_path} not found. {ARXIV_HOW_TO_GET}")
    from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

    builder = tfds.builder(ARXIV_TFDS_NAME, data_dir=data_dir)
    try:
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    except (NonMatchingChecksumError, zipfile.BadZipFile) as e:
        raise InputError(
            f"{zip_path} is not the arXiv archive TFDS expects ({type(e).__name__}: "
            f"{json_lines.first_line(str(e))}); download it again. {ARXIV_HOW_TO_GET}"
        ) from None
    return _tfds_path(data_dir, ARXIV_TFDS_NAME)
