"""terra.evaluation.summaries.read_examples: every summarization example carries the id its
source gives the document (Cohan ``article_id``, TFDS record id, embedded pair origin), read
through the real task pipelines from tiny on-disk datasets; the model's batches are unchanged."""

import re

import pytest
import seqio

from terra.data import embedded, feature_converters, fixtures, pipeline, sources, tasks
from terra.evaluation import summaries
from terra.gin_config import parsing

LENGTHS = {"inputs": 64, "targets": 16}
ENCODER_DECODER_FEATURES = {
    "encoder_input_tokens",
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
}
LENGTH_CONCAT_FEATURES = ENCODER_DECODER_FEATURES | {
    "concat_input_tokens",
    "concat_target_tokens",
    "concat_loss_weights",
    "encoder_lengths",
}
TFDS_ID = re.compile(r"^scientific_papers-(train|validation|test)\.tfrecord-\d{5}-of-\d{5}__\d+$")


def _paper(i):
    article = [f"sentence {j} of paper {i} about sparse layers ." for j in range(5)]
    record = fixtures.cohan_record(i, article, [f"paper {i} is about sparsity .", "it decodes fast ."])
    record["article_id"] = f"{1000 + i}.{i:05d}"  # arXiv-style ids, as the real files have
    return record


PAPERS = {
    "train": [_paper(i) for i in range(6)],
    "validation": [_paper(i) for i in range(10, 14)],
    "test": [_paper(20)],
}


@pytest.fixture(scope="module")
def arxiv_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arxiv")
    cohan = fixtures.write_cohan(str(root / "raw"), PAPERS)
    tfds_dir = str(root / "tfds")
    fixtures.write_arxiv_tfds(tfds_dir, PAPERS)
    return {"cohan": cohan, "tfds": tfds_dir}


def _abstract(record):
    return "\n".join(s.replace("<S>", "").replace("</S>", "").strip() for s in record["abstract_text"])


def test_cohan_examples_carry_their_article_id(arxiv_dirs):
    parsing.parse_gin([], [f"terra.data.arxiv_source.cohan_path = {arxiv_dirs['cohan']!r}"])
    examples = summaries.read_examples(tasks.get_task("arxiv_summarization"), "validation", LENGTHS)
    assert [e.id for e in examples] == [r["article_id"] for r in PAPERS["validation"]]  # file order, unshuffled
    by_id = {r["article_id"]: r for r in PAPERS["validation"]}
    for e in examples:
        assert e.target_text == _abstract(by_id[e.id])
        assert e.input_text == "\n".join(by_id[e.id]["article_text"])
    assert [e.id for e in summaries.read_examples(tasks.get_task("arxiv_summarization"), "validation", LENGTHS, 2)] == [
        r["article_id"] for r in PAPERS["validation"][:2]
    ]


def test_tfds_examples_carry_the_tfds_record_id(arxiv_dirs):
    parsing.parse_gin([], [f"terra.data.arxiv_source.tfds_data_dir = {arxiv_dirs['tfds']!r}"])
    examples = summaries.read_examples(tasks.get_task("arxiv_summarization"), "validation", LENGTHS)
    assert len(examples) == len(PAPERS["validation"])
    ids = [e.id for e in examples]
    assert len(set(ids)) == len(ids) and all(TFDS_ID.match(i) for i in ids), ids
    assert all("-validation." in i for i in ids)
    # The id names the record: the same id has the same paper in a second, shuffled read of the source.
    abstracts = {e.id: e.target_text for e in examples}
    source = sources.arxiv_tfds_source(data_dir=arxiv_dirs["tfds"])
    reread = {
        ex["id"].decode(): "\n".join(line.strip() for line in ex["abstract"].decode().split("\n"))
        for ex in source.get_dataset("validation", shuffle=True, seed=7).as_numpy_iterator()
    }
    assert reread == abstracts
    assert sorted(abstracts.values()) == sorted(_abstract(r) for r in PAPERS["validation"])


def test_embedded_examples_name_the_docstring_or_module_they_come_from():
    examples = summaries.read_examples(tasks.get_task("embedded_summarization"), "validation", LENGTHS)
    ids = [e.id for e in examples]
    assert len(ids) == embedded.read_manifest()["summarization"]["validation"]["pairs"]
    assert len(set(ids)) == len(ids)
    assert all(re.match(r"^(docstring|module):[\w/.-]+\.py(:[\w.]+(#\d+)?)?$", i) for i in ids), ids[:5]
    assert any(i.startswith("module:") for i in ids) and any(i.startswith("docstring:") for i in ids)
    assert [
        e.id for e in summaries.read_examples(tasks.get_task("embedded_summarization"), "validation", LENGTHS, 5)
    ] == ids[:5]


def test_a_task_whose_source_names_nothing_numbers_its_examples():
    examples = summaries.read_examples(
        tasks.get_task("synthetic_copy"), "validation", {"inputs": 160, "targets": 160}, 4
    )
    assert [e.id for e in examples] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("data", ["cohan", "tfds", "embedded"])
@pytest.mark.slow
def test_training_batches_have_exactly_the_model_features(data, arxiv_dirs):
    bindings = {
        "cohan": [f"terra.data.arxiv_source.cohan_path = {arxiv_dirs['cohan']!r}"],
        "tfds": [f"terra.data.arxiv_source.tfds_data_dir = {arxiv_dirs['tfds']!r}"],
        "embedded": [],
    }[data]
    parsing.parse_gin([], bindings)
    task = "embedded_summarization" if data == "embedded" else "arxiv_summarization"
    assert "id" in tasks.get_task(task).get_dataset(LENGTHS, split="train", shuffle=False).element_spec
    for converter, expected in (
        (None, ENCODER_DECODER_FEATURES),
        (feature_converters.length_concat_converter(), LENGTH_CONCAT_FEATURES),
    ):
        # Unshuffled: the features do not depend on the order, and a shuffled stream would first
        # preprocess a 1,000-example shuffle buffer.
        ds = pipeline.get_dataset(
            tasks.get_task(task), feature_lengths=LENGTHS, batch_size=2, feature_converter=converter, shuffle=False
        )
        assert set(ds.element_spec) == expected
        batch = next(pipeline.BatchIterator(ds))
        assert set(batch) == expected and batch["encoder_input_tokens"].shape == (2, LENGTHS["inputs"])


def test_the_tfds_ids_survive_per_host_sharding(arxiv_dirs):
    parsing.parse_gin([], [f"terra.data.arxiv_source.tfds_data_dir = {arxiv_dirs['tfds']!r}"])
    task = tasks.get_task("arxiv_summarization")
    everything = {e.id for e in summaries.read_examples(task, "train", LENGTHS)}
    parts = [
        {
            ex["id"].decode()
            for ex in task.get_dataset(
                LENGTHS, split="train", shuffle=False, shard_info=seqio.ShardInfo(i, 2)
            ).as_numpy_iterator()
        }
        for i in range(2)
    ]
    assert parts[0] | parts[1] == everything and not parts[0] & parts[1] and all(parts)
    assert len(everything) == len(PAPERS["train"])
