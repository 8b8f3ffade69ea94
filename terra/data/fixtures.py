"""Tiny real on-disk datasets in every format terra reads, for the tests and the input-pipeline
benchmark: prepared TFDS ``c4/en`` and ``scientific_papers/arxiv`` directories, allenai/c4 JSON
shards and Cohan JSON lines; and a SentencePiece model of any size. Reading them exercises
exactly the production code paths (the tests also check that the arXiv directory reads as the
real TFDS builder's does)."""

import gzip
import json
import os
from typing import Mapping, Optional, Sequence

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
        name="c4",
        config="en",
        version=version,
        data_dir=data_dir,
        features=features,
        split_datasets={split: examples(texts) for split, texts in docs.items()},
        disable_shuffling=False,
    )
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


def write_arxiv_tfds(data_dir: str, papers: Mapping[str, Sequence[dict]]) -> str:
    """``papers = {"train": [cohan record, ...], ...}`` -> a prepared TFDS
    ``<data_dir>/scientific_papers/arxiv/1.1.1`` with the features and text the real
    ``scientific_papers`` builder makes of the same Cohan files: paragraphs joined by newlines,
    the abstract's ``<S>``/``</S>`` tags removed."""
    import tensorflow_datasets as tfds

    name, rest = sources.ARXIV_TFDS_NAME.split("/")
    config, version = rest.split(":")
    features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in ("article", "abstract", "section_names")})

    def examples(records):
        for record in records:
            abstract = "\n".join(record["abstract_text"]).replace("<S>", "").replace("</S>", "")
            yield (
                record["article_id"],
                {
                    "article": "\n".join(record["article_text"]),
                    "abstract": abstract,
                    "section_names": "\n".join(record["section_names"]),
                },
            )

    tfds.dataset_builders.store_as_tfds_dataset(
        name=name,
        config=config,
        version=version,
        data_dir=data_dir,
        features=features,
        split_datasets={split: examples(records) for split, records in papers.items()},
        disable_shuffling=False,
    )
    return os.path.join(data_dir, name, config, version)


def write_sentencepiece_model(path: str, vocab_size: int, texts: Optional[Sequence[str]] = None) -> str:
    """A real SentencePiece model with exactly ``vocab_size`` pieces, in T5's id layout, at
    ``path``: trained on ``texts`` (default: a few sentences) as ``terra-vocab`` trains, then
    filled up with unused pieces (never produced by encoding). It stands in for a vocabulary of
    the paper's size (T5's 32,000-piece ``cc_all.32000``, which cannot be downloaded offline)
    where only the size and the id layout matter; training a real 32,000-piece model needs tens
    of MB of text. Returns the ``.model`` path."""
    from sentencepiece import sentencepiece_model_pb2

    from terra.data import vocabularies

    texts = list(texts or [f"Document {i}: sparse layers make decoding fast." for i in range(40)])
    trained = vocabularies.train_sentencepiece(texts, path, vocab_size=min(vocab_size, 300), hard_vocab_limit=False)
    model = sentencepiece_model_pb2.ModelProto()
    with open(trained, "rb") as f:
        model.ParseFromString(f.read())
    if len(model.pieces) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is below the {len(model.pieces)} pieces the text needs.")
    unused = sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED
    for i in range(vocab_size - len(model.pieces)):
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = f"<unused_{i}>", 0.0, unused
    model.trainer_spec.vocab_size = vocab_size
    with open(trained, "wb") as f:
        f.write(model.SerializeToString())
    return trained
