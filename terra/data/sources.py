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

import json
import os
from typing import Mapping, Optional

import seqio
import tensorflow as tf

from terra.documents import cohan_example
from terra.errors import DataNotFoundError

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
    """A ``seqio.FileDataSource`` over local files that checks they exist. (A seqio Task shards
    by example when a split has fewer files than hosts, e.g. the single Cohan file per split.)"""

    def __init__(self, read_file_fn, split_to_filepattern, *, description: str, how_to_get: str):
        self.description = description
        self.how_to_get = how_to_get
        super().__init__(read_file_fn=read_file_fn, split_to_filepattern=split_to_filepattern)

    def check_available(self, split: Optional[str] = None) -> None:
        splits = [split] if split is not None else list(self.splits)
        for s in splits:
            if s not in self._split_to_filepattern:
                raise DataNotFoundError(f"{self.description} has no split '{s}'; it has {sorted(self.splits)}.")
            # seqio's list_shards returns a pattern without wildcards unchecked.
            if not tf.io.gfile.glob(self._split_to_filepattern[s]):
                raise DataNotFoundError(
                    f"{self.description}: no file matches {self._split_to_filepattern[s]} (split '{s}'). "
                    f"{self.how_to_get}"
                )

    def get_dataset(self, split="train", shuffle=True, seed=None, shard_info=None, **kwargs):
        self.check_available(split)
        return super().get_dataset(split, shuffle, seed, shard_info, **kwargs)


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


def _c4_patterns(path: str) -> dict:
    """A directory (the clone's root, its ``en/`` folder or any folder of shards) or a glob
    containing ``{split}``."""
    path = os.path.expanduser(path)
    if "{split}" in path:
        return {"train": path.format(split="train"), "validation": path.format(split="validation")}
    folder = os.path.join(path, "en") if os.path.isdir(os.path.join(path, "en")) else path
    return {s: os.path.join(folder, f"c4-{s}.*.json.gz") for s in ("train", "validation")}


def _parse_c4_line(line: tf.Tensor) -> dict:
    # TF has no JSON op (tf.io.decode_json_example only reads tf.Example JSON).
    def parse(raw):
        doc = json.loads(raw.numpy())
        return doc.get("text", ""), doc.get("url", ""), doc.get("timestamp", "")

    text, url, timestamp = tf.py_function(parse, [line], [tf.string, tf.string, tf.string])
    return {
        "text": tf.ensure_shape(text, []),
        "url": tf.ensure_shape(url, []),
        "timestamp": tf.ensure_shape(timestamp, []),
    }


def c4_json_source(*, path: str) -> LocalFileSource:
    """allenai/c4 JSON-lines shards (gzip; fields ``text``, ``timestamp``, ``url``), given the
    directory holding them or a glob with ``{split}``, e.g. ``/data/c4/en/c4-{split}.000*-of-*.json.gz``."""
    return LocalFileSource(
        lambda f: tf.data.TextLineDataset(f, compression_type="GZIP").map(
            _parse_c4_line, num_parallel_calls=tf.data.AUTOTUNE
        ),
        _c4_patterns(path),
        description=f"C4 JSON shards under {path}",
        how_to_get=C4_HOW_TO_GET,
    )


# --- arXiv ------------------------------------------------------------------------------------


def arxiv_tfds_source(*, data_dir: Optional[str] = None) -> ReadOnlyTfdsSource:
    """arXiv from a prepared TFDS ``scientific_papers/arxiv:1.1.1`` directory; fields
    ``article``, ``abstract`` (one sentence per line), ``section_names`` and ``id``. The TFDS
    builder does not keep the papers' ``article_id``, so ``id`` is TFDS's record id (see
    :class:`ReadOnlyTfdsSource`)."""
    return ReadOnlyTfdsSource(ARXIV_TFDS_NAME, data_dir=data_dir, how_to_get=ARXIV_HOW_TO_GET, add_ids=True)


COHAN_FEATURES = ("article", "abstract", "section_names", "id")


def _parse_cohan_line(line: tf.Tensor) -> dict:
    def parse(raw):
        ex = cohan_example(json.loads(raw.numpy()))
        return [ex[k] for k in COHAN_FEATURES]

    values = tf.py_function(parse, [line], [tf.string] * len(COHAN_FEATURES))
    return {k: tf.ensure_shape(v, []) for k, v in zip(COHAN_FEATURES, values)}


COHAN_SPLIT_FILES = {"train": "train.txt", "validation": "val.txt", "test": "test.txt"}


def arxiv_cohan_source(*, path: str) -> LocalFileSource:
    """The extracted ``arxiv-dataset/{train,val,test}.txt`` (JSON lines, one paper each), given
    that folder or its parent; features as :func:`cohan_example`."""
    folder = os.path.expanduser(path)
    if os.path.isdir(os.path.join(folder, "arxiv-dataset")):
        folder = os.path.join(folder, "arxiv-dataset")
    return LocalFileSource(
        lambda f: tf.data.TextLineDataset(f).map(_parse_cohan_line, num_parallel_calls=tf.data.AUTOTUNE),
        {split: os.path.join(folder, name) for split, name in COHAN_SPLIT_FILES.items()},
        description=f"arXiv (Cohan JSON lines) under {folder}",
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
    builder = tfds.builder(ARXIV_TFDS_NAME, data_dir=data_dir)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    return _tfds_path(data_dir, ARXIV_TFDS_NAME)
