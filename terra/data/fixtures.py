"""Tiny real on-disk datasets in every format terra reads, for the tests and the input-pipeline
benchmark (``data_and_seqio.md`` §3): a prepared TFDS ``c4/en`` directory, a prepared TFDS
``scientific_papers/arxiv`` directory made by the real builder from Cohan files, allenai/c4
JSON shards and Cohan JSON lines. Reading them exercises exactly the production code paths."""

import gzip
import json
import os
from typing import Mapping, Sequence
from unittest import mock

from terra.data import sources

C4_FEATURES = ("text", "url", "content-type", "content-length", "timestamp")


def c4_record(i: int, text: str) -> dict:
    return {"text": text, "url": f"https://example.com/{i}", "timestamp": "2019-04-25T12:57:54Z"}


def write_c4_tfds(data_dir: str, docs: Mapping[str, Sequence[str]], *, version: str = sources.C4_TFDS_VERSION) -> str:
    """``docs = {"train": [...], "validation": [...]}`` -> ``<data_dir>/c4/en/<version>``."""
    import tensorflow_datasets as tfds

    features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in C4_FEATURES})

    def examples(texts):
        for i, text in enumerate(texts):
            record = c4_record(i, text)
            yield i, {**record, "content-type": "text/plain", "content-length": str(len(text))}

    tfds.dataset_builders.store_as_tfds_dataset(
        name="c4", config="en", version=version, data_dir=data_dir, features=features,
        split_datasets={split: examples(texts) for split, texts in docs.items()}, disable_shuffling=False)
    return os.path.join(data_dir, "c4", "en", version)


def write_c4_json(directory: str, docs: Mapping[str, Sequence[str]], *, shards: int = 2) -> str:
    """allenai/c4 layout: ``<directory>/en/c4-<split>.0000k-of-0000n.json.gz``."""
    folder = os.path.join(directory, "en")
    os.makedirs(folder, exist_ok=True)
    for split, texts in docs.items():
        for k in range(shards):
            with gzip.open(os.path.join(folder, f"c4-{split}.{k:05d}-of-{shards:05d}.json.gz"), "wt") as f:
                for i in range(k, len(texts), shards):
                    f.write(json.dumps(c4_record(i, texts[i])) + "\n")
    return folder


def cohan_record(i: int, article_sentences: Sequence[str], abstract_sentences: Sequence[str]) -> dict:
    """One paper as the real files store it: abstract sentences wrapped in ``<S> ... </S>``."""
    return {
        "article_id": f"paper{i}",
        "abstract_text": [f"<S> {s} </S>" for s in abstract_sentences],
        "article_text": list(article_sentences),
        "labels": None,
        "section_names": ["introduction", "conclusion"],
        "sections": [list(article_sentences)],
    }


def write_cohan(directory: str, papers: Mapping[str, Sequence[dict]]) -> str:
    """``papers = {"train": [record, ...], "validation": [...], "test": [...]}`` ->
    ``<directory>/arxiv-dataset/{train,val,test}.txt``."""
    folder = os.path.join(directory, "arxiv-dataset")
    os.makedirs(folder, exist_ok=True)
    for split, records in papers.items():
        with open(os.path.join(folder, sources.COHAN_SPLIT_FILES[split]), "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    return folder


def prepare_arxiv_tfds(data_dir: str, cohan_directory: str) -> str:
    """Run the real ``scientific_papers`` builder over local Cohan files (its download step
    replaced by the directory, as TFDS's own builder tests do). ``cohan_directory`` holds
    ``arxiv-dataset/`` (what :func:`write_cohan` was given)."""
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()
    with mock.patch.object(tfds.download.DownloadManager, "download_and_extract",
                           return_value={"arxiv": cohan_directory, "pubmed": cohan_directory}):
        tfds.builder(sources.ARXIV_TFDS_NAME, data_dir=data_dir).download_and_prepare()
    return os.path.join(data_dir, "scientific_papers", "arxiv", "1.1.1")
