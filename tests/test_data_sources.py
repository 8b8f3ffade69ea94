"""The real read paths for C4 and arXiv, on tiny real on-disk datasets the tests write: a
prepared TFDS c4/en directory, the real scientific_papers builder over Cohan files (and the
package's own arXiv TFDS writer, checked against it), allenai/c4 JSON shards and Cohan JSON
lines; and the errors when data is missing."""

import os
import socket
import time
from unittest import mock

import pytest
import seqio

from terra.data import fixtures, sources
from terra.errors import DataNotFoundError

TRAIN = [f"Document {i} talks about sparse layers.\nIt has a second line {i}." for i in range(12)]
VALIDATION = ["A validation document.", "Another validation document."]


def _paper(i):
    article = [f"sentence {j} of paper {i} ." for j in range(6)]
    return fixtures.cohan_record(i, article, [f"paper {i} is about sparsity .", "it is fast ."])


def _prepare_arxiv_with_the_real_builder(data_dir: str, cohan_directory: str) -> None:
    """Run TFDS's own ``scientific_papers`` builder over local Cohan files, its download step
    replaced by the directory (as TFDS's own builder tests do)."""
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    with mock.patch.object(
        tfds.download.DownloadManager,
        "download_and_extract",
        return_value={"arxiv": cohan_directory, "pubmed": cohan_directory},
    ):
        tfds.builder(sources.ARXIV_TFDS_NAME, data_dir=data_dir).download_and_prepare()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data"))
    fixtures.write_c4_tfds(os.path.join(root, "tfds"), {"train": TRAIN, "validation": VALIDATION})
    fixtures.write_c4_json(os.path.join(root, "c4json"), {"train": TRAIN, "validation": VALIDATION}, shards=3)
    papers = {"train": [_paper(i) for i in range(4)], "validation": [_paper(10), _paper(11)], "test": [_paper(20)]}
    fixtures.write_cohan(os.path.join(root, "raw"), papers)
    _prepare_arxiv_with_the_real_builder(os.path.join(root, "tfds"), os.path.join(root, "raw"))
    fixtures.write_arxiv_tfds(os.path.join(root, "tfds_fixture"), papers)
    return root


def _texts(source, split, key):
    return sorted(ex[key].decode() for ex in source.get_dataset(split, shuffle=False).as_numpy_iterator())


def test_c4_reads_a_prepared_tfds_directory_through_seqio(data_dir):
    source = sources.c4_tfds_source(data_dir=os.path.join(data_dir, "tfds"))
    assert isinstance(source, seqio.TfdsDataSource)
    assert _texts(source, "train", "text") == sorted(TRAIN)
    assert _texts(source, "validation", "text") == sorted(VALIDATION)


def test_c4_json_shards_read_gzip_lines_with_text_url_and_timestamp(data_dir):
    source = sources.c4_json_source(path=os.path.join(data_dir, "c4json"))
    assert len(source.list_shards("train")) == 3
    assert _texts(source, "train", "text") == sorted(TRAIN)
    first = next(source.get_dataset("validation", shuffle=False).as_numpy_iterator())
    assert first["url"].startswith(b"https://") and first["timestamp"].startswith(b"2019")
    # A glob with {split} works as well as the clone's directory.
    pattern = os.path.join(data_dir, "c4json", "en", "c4-{split}.*.json.gz")
    assert _texts(sources.c4_json_source(path=pattern), "validation", "text") == sorted(VALIDATION)


def test_arxiv_tfds_directory_prepared_by_the_real_builder_is_read(data_dir):
    source = sources.arxiv_tfds_source(data_dir=os.path.join(data_dir, "tfds"))
    examples = list(source.get_dataset("validation", shuffle=False).as_numpy_iterator())
    assert len(examples) == 2
    assert {"article", "abstract", "section_names"} <= set(examples[0])
    assert b"sentence 0 of paper 1" in examples[0]["article"]


def test_the_fixture_arxiv_tfds_directory_reads_as_the_real_builders(data_dir):
    real = sources.arxiv_tfds_source(data_dir=os.path.join(data_dir, "tfds"))
    fixture = sources.arxiv_tfds_source(data_dir=os.path.join(data_dir, "tfds_fixture"))
    for split in ("train", "validation", "test"):
        for key in ("article", "abstract", "section_names"):
            assert _texts(fixture, split, key) == _texts(real, split, key), (split, key)


def test_tfds_arxiv_examples_are_named_by_their_tfds_record_id(data_dir):
    def articles_by_id(directory, split, **read):
        source = sources.arxiv_tfds_source(data_dir=os.path.join(data_dir, directory))
        return {ex["id"].decode(): ex["article"] for ex in source.get_dataset(split, **read).as_numpy_iterator()}

    real = articles_by_id("tfds", "train", shuffle=False)
    assert len(real) == 4
    assert all(i.startswith("scientific_papers-train.tfrecord-") and "__" in i for i in real)
    assert articles_by_id("tfds", "train", shuffle=True, seed=3) == real  # the id follows its record
    # The package's writer lays the records out as the real builder does, ids included.
    for split in ("train", "validation", "test"):
        assert articles_by_id("tfds_fixture", split, shuffle=False) == articles_by_id("tfds", split, shuffle=False)
    # Without ids the source reads exactly what seqio's TfdsDataSource reads.
    plain = sources.ReadOnlyTfdsSource(sources.ARXIV_TFDS_NAME, data_dir=os.path.join(data_dir, "tfds"))
    assert set(next(plain.get_dataset("train", shuffle=False).as_numpy_iterator())) == {
        "article",
        "abstract",
        "section_names",
    }


def test_cohan_files_yield_the_tfds_features_one_sentence_per_line(data_dir):
    source = sources.arxiv_cohan_source(path=os.path.join(data_dir, "raw"))
    ex = next(source.get_dataset("test", shuffle=False).as_numpy_iterator())
    assert ex["abstract"] == b"paper 20 is about sparsity .\nit is fast ."  # tags and spaces removed
    assert ex["article"].split(b"\n")[0] == b"sentence 0 of paper 20 ."
    assert ex["section_names"] == b"introduction\nconclusion"
    assert ex["id"] == b"paper20"  # the record's article_id
    assert _texts(source, "validation", "id") == ["paper10", "paper11"]
    # Same articles as the TFDS builder produced from the same files.
    tfds_source = sources.arxiv_tfds_source(data_dir=os.path.join(data_dir, "tfds"))
    assert _texts(source, "train", "article") == _texts(tfds_source, "train", "article")


def test_sharding_gives_each_host_a_disjoint_part(data_dir):
    source = sources.c4_json_source(path=os.path.join(data_dir, "c4json"))
    parts = [
        sorted(
            ex["text"].decode()
            for ex in source.get_dataset("train", shuffle=False, shard_info=seqio.ShardInfo(i, 3)).as_numpy_iterator()
        )
        for i in range(3)
    ]
    assert sorted(sum(parts, [])) == sorted(TRAIN) and all(parts)


def _refuse_network(*args, **kwargs):
    raise AssertionError("terra tried to open a network connection")


@pytest.mark.parametrize(
    "make_source, path_part",
    [
        (lambda d: sources.c4_tfds_source(data_dir=d), os.path.join("c4", "en", "3.1.0")),
        (lambda d: sources.arxiv_tfds_source(data_dir=d), os.path.join("scientific_papers", "arxiv", "1.1.1")),
        (lambda d: sources.c4_json_source(path=d), "no such file or folder"),
        (lambda d: sources.arxiv_cohan_source(path=d), "train.txt"),
    ],
)
def test_missing_data_fails_fast_naming_the_path_without_network(tmp_path, make_source, path_part):
    empty = str(tmp_path / "empty")
    start = time.perf_counter()
    with mock.patch.object(socket.socket, "connect", _refuse_network):
        with pytest.raises(DataNotFoundError) as error:
            make_source(empty).get_dataset("train")
    assert time.perf_counter() - start < 1.0
    message = str(error.value)
    assert os.path.join(empty, "") in message or empty in message
    assert path_part in message
    assert "download" in message.lower() or "prepare" in message.lower()


def test_prepare_arxiv_refuses_without_the_zip(tmp_path):
    with pytest.raises(DataNotFoundError, match="arxiv-dataset.zip not found"):
        sources.prepare_arxiv(str(tmp_path))
