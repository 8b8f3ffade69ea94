"""terra.data.catalog and terra.data.tasks: what each task trains (its objective, from the table
of the tasks, without building it), the paper's C4 task, and the check that a model's vocabulary
and length fit a task."""

import dataclasses
import logging

import gin
import numpy as np
import pytest
import seqio

from terra.data import catalog, feature_converters, fixtures, tasks
from terra.errors import ConfigError
from terra.gin_config import parsing


def test_every_task_has_one_of_the_objectives():
    assert all(name == spec.name for name, spec in catalog.TASKS.items())
    for name in catalog.TASKS:
        assert catalog.objective(name) in tasks.OBJECTIVES, name
    assert set(tasks.OBJECTIVES) == {"summarization", "span_corruption", "prefix_lm", "synthetic"}
    for name, members in catalog.MIXTURES.items():
        assert name not in catalog.TASKS and set(members) <= set(catalog.TASKS), name
    assert tasks.task_names() == sorted(catalog.TASKS) + sorted(catalog.MIXTURES)


@pytest.mark.parametrize(
    "name, objective",
    [
        ("arxiv_summarization", "summarization"),
        ("embedded_summarization", "summarization"),
        ("c4_span_corruption", "span_corruption"),
        ("c4_span_corruption_paper", "span_corruption"),
        ("c4_single_word_masking", "span_corruption"),
        ("embedded_span_corruption", "span_corruption"),
        ("c4_lm", "prefix_lm"),
        ("embedded_lm", "prefix_lm"),
        ("synthetic_copy", "synthetic"),
        ("synthetic_addition", "synthetic"),
        ("synthetic_copy_digits", "synthetic"),
        ("synthetic_addition_digits_lm", "synthetic"),
    ],
)
def test_task_objectives(name, objective):
    assert catalog.objective(name) == objective
    assert catalog.is_summarization(name) == (objective == "summarization")


def test_the_objective_comes_from_the_registry_not_the_name(monkeypatch):
    # A summarization task whose name says nothing, and a name that says summarization but is not.
    papers = dataclasses.replace(catalog.TASKS["arxiv_summarization"], name="papers_v2")
    as_lm = dataclasses.replace(catalog.TASKS["embedded_lm"], name="summarization_as_lm")
    monkeypatch.setitem(catalog.TASKS, "papers_v2", papers)
    monkeypatch.setitem(catalog.TASKS, "summarization_as_lm", as_lm)
    assert catalog.is_summarization("papers_v2") and not catalog.is_summarization("summarization_as_lm")
    with pytest.raises(ConfigError, match="task 'unclassified' has no objective; add it to .*catalog.TASKS"):
        catalog.TaskSpec("unclassified", None, catalog.TASKS["embedded_lm"].build)
    with pytest.raises(ConfigError, match="task 'unclassified' has the unknown objective 'lm'; add it to"):
        catalog.TaskSpec("unclassified", "lm", catalog.TASKS["embedded_lm"].build)


def test_built_tasks_and_mixtures_have_the_objectives_of_their_names():
    copy = tasks.get_task("synthetic_copy")
    assert isinstance(copy, seqio.Task) and tasks.task_objective(copy) == "synthetic"
    mixture = tasks.get_task("synthetic")
    assert isinstance(mixture, seqio.Mixture)
    assert tasks.task_objective(mixture) == catalog.objective("synthetic") == "synthetic"
    assert not tasks.is_summarization(mixture)


def test_resolve_takes_a_name_or_a_task_and_nothing_else():
    copy = tasks.get_task("synthetic_copy")
    assert tasks.resolve("synthetic_copy") is copy and tasks.resolve(copy) is copy
    mixture = tasks.get_task("synthetic")
    assert tasks.resolve("synthetic") is mixture and tasks.resolve(mixture) is mixture
    with pytest.raises(ConfigError, match="Did you mean 'synthetic_copy'"):
        tasks.resolve("synthetic_cpy")
    with pytest.raises(ConfigError, match="a task is the name of one of terra's tasks .* not int 3"):
        tasks.resolve(3)


# --- registration: once per definition ----------------------------------------------------------


def test_a_task_is_registered_once_and_reused_while_its_definition_stays():
    copy, mixture = tasks.get_task("synthetic_copy"), tasks.get_task("synthetic")
    assert tasks.get_task("synthetic_copy") is copy and seqio.TaskRegistry.get("synthetic_copy") is copy
    assert tasks.get_task("synthetic") is mixture and seqio.MixtureRegistry.get("synthetic") is mixture


def test_a_task_defined_differently_by_the_config_in_force_is_registered_again(caplog):
    copy, mixture = tasks.get_task("synthetic_copy"), tasks.get_task("synthetic")
    gin.bind_parameter("terra.data.copy_dataset.train_length", 3)
    with caplog.at_level(logging.INFO):
        again = tasks.get_task("synthetic_copy")
    assert again is not copy and seqio.TaskRegistry.get("synthetic_copy") is again
    assert "'synthetic_copy' is defined differently under the gin config in force" in caplog.text
    examples = again.source.get_dataset("train").take(50).as_numpy_iterator()
    assert {len(example["inputs"]) for example in examples} == {1, 2}  # the new binding reaches the source
    assert tasks.get_task("synthetic_copy") is again
    again_mixture = tasks.get_task("synthetic")  # its member changed, so it is built again with it
    assert again_mixture is not mixture and again in again_mixture.tasks


def test_data_changed_on_disk_under_the_same_binding_is_a_different_definition(tmp_path):
    folder = fixtures.write_c4_json(str(tmp_path / "c4"), {"train": ["one document", "another"]}, shards=1)
    gin.bind_parameter("terra.data.c4_source.json_path", folder)
    task = tasks.get_task("c4_lm")
    assert tasks.get_task("c4_lm") is task and len(task.source.list_shards("train")) == 1
    fixtures.write_c4_json(str(tmp_path / "c4"), {"validation": ["a third"]}, shards=1)
    again = tasks.get_task("c4_lm")
    assert again is not task and again.source.list_shards("validation") and seqio.TaskRegistry.get("c4_lm") is again


def test_a_task_other_code_registered_under_a_terra_name_is_replaced_with_a_warning(caplog):
    tasks.get_task("synthetic_addition")
    seqio.TaskRegistry.remove("synthetic_addition")
    foreign = seqio.TaskRegistry.add(
        "synthetic_addition",
        source=seqio.FunctionDataSource(lambda split, shuffle_files: None, ["train"]),
        output_features={},
    )
    with caplog.at_level(logging.WARNING):
        task = tasks.get_task("synthetic_addition")
    assert task is not foreign and seqio.TaskRegistry.get("synthetic_addition") is task
    assert "replacing the seqio provider 'synthetic_addition' that other code registered" in caplog.text


@pytest.mark.slow
def test_a_mixture_of_different_objectives_is_a_mixture(monkeypatch):
    monkeypatch.setitem(tasks.MIXTURES, "papers_and_c4", ("arxiv_summarization", "c4_span_corruption"))
    monkeypatch.setitem(tasks.MIXTURES, "two_summaries", ("arxiv_summarization", "embedded_summarization"))
    assert catalog.objective("papers_and_c4") == "mixture" and not catalog.is_summarization("papers_and_c4")
    assert catalog.objective("two_summaries") == "summarization" and catalog.is_summarization("two_summaries")
    tasks.get_task("synthetic")
    mixed = "test_synthetic_and_lm"
    if mixed in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(mixed)
    tasks.get_task("embedded_lm")
    mixture = seqio.MixtureRegistry.add(mixed, [("synthetic_copy", 1.0), ("embedded_lm", 1.0)])
    try:
        assert tasks.task_objective(mixture) == "mixture"
    finally:
        seqio.MixtureRegistry.remove(mixed)


def test_unknown_tasks_have_no_objective():
    with pytest.raises(ConfigError, match="Did you mean 'arxiv_summarization'"):
        catalog.objective("arxiv_summarisation")
    foreign = seqio.Task(
        "someone_elses_task",
        source=seqio.FunctionDataSource(lambda split, shuffle_files: None, ["train"]),
        output_features={},
    )
    with pytest.raises(ConfigError, match="'someone_elses_task' is not one of terra's tasks"):
        tasks.is_summarization(foreign)


# --- check_vocabulary_and_lengths --------------------------------------------------------------


def test_a_model_that_fits_passes_the_check():
    copy = tasks.get_task("synthetic_copy")
    vocab_size = copy.output_features["targets"].vocabulary.vocab_size
    tasks.check_vocabulary_and_lengths(copy, {"inputs": 64, "targets": 64}, vocab_size=vocab_size, max_len=64)
    tasks.check_vocabulary_and_lengths(
        tasks.get_task("synthetic"), {"inputs": 8, "targets": 8}, vocab_size=512, max_len=8
    )


def test_a_too_small_vocabulary_names_the_binding_to_change():
    copy = tasks.get_task("synthetic_copy")
    needed = copy.output_features["inputs"].vocabulary.vocab_size  # bytes: 259 ids
    with pytest.raises(ConfigError) as error:
        tasks.check_vocabulary_and_lengths(copy, {"inputs": 16, "targets": 16}, vocab_size=needed - 1, max_len=64)
    assert str(error.value) == (
        f"the task's 'inputs' vocabulary has {needed} ids but the model's vocab_size is {needed - 1}; "
        f"bind TransformerConfig.vocab_size = {needed} (or a multiple of 128 above it)."
    )


def test_too_long_features_name_the_binding_to_change():
    copy = tasks.get_task("synthetic_copy")
    with pytest.raises(ConfigError) as error:
        tasks.check_vocabulary_and_lengths(copy, {"inputs": 100, "targets": 130}, vocab_size=512, max_len=64)
    assert str(error.value) == (
        "feature lengths {'inputs': 100, 'targets': 130} exceed the model's max_len=64; "
        "bind TransformerConfig.max_len = 130 or shorten the features."
    )
    # Both problems at once, in one error: one run reports all of them.
    with pytest.raises(ConfigError) as error:
        tasks.check_vocabulary_and_lengths(copy, {"inputs": 100, "targets": 130}, vocab_size=10, max_len=64)
    assert str(error.value).startswith("2 problems, each to fix before a run: (1) the task's 'inputs' vocabulary")
    assert "bind TransformerConfig.vocab_size = 259" in str(error.value)
    assert "(2) feature lengths {'inputs': 100, 'targets': 130} exceed" in str(error.value)


def test_a_language_model_sequence_beyond_max_len_names_the_binding_to_change():
    # The language-model form's decoder holds inputs + targets: 100 + 130 > 200, though each fits.
    copy = tasks.get_task("synthetic_copy")
    lengths = {"inputs": 100, "targets": 130}
    tasks.check_vocabulary_and_lengths(copy, lengths, vocab_size=512, max_len=200)
    with pytest.raises(ConfigError) as error:
        tasks.check_vocabulary_and_lengths(
            copy,
            lengths,
            vocab_size=512,
            max_len=200,
            feature_converter=feature_converters.language_model_converter(),
        )
    assert "model sequences {'decoder_input_tokens': 230}" in str(error.value)
    assert "bind TransformerConfig.max_len = 230" in str(error.value)
    # The encoder-decoder form's sequences are the features themselves.
    tasks.check_vocabulary_and_lengths(
        copy, lengths, vocab_size=512, max_len=200, feature_converter=feature_converters.encoder_decoder_converter()
    )


# --- the paper's C4 task -------------------------------------------------------------------------

C4_DOCS = [f"Document {i}: sparse layers make decoding fast, and reversible ones save memory. " * 12 for i in range(4)]


@pytest.mark.parametrize("source", ["json", "tfds"])
def test_the_paper_c4_task_cuts_fixed_chunks_and_reuses_the_top_pieces_as_sentinels(source, tmp_path):
    vocabulary_path = fixtures.write_sentencepiece_model(str(tmp_path / "spm.model"), 1000, texts=C4_DOCS)
    if source == "json":
        json_dir = fixtures.write_c4_json(str(tmp_path / "c4"), {"validation": C4_DOCS})
        data = f"terra.data.c4_source.json_path = {json_dir!r}"
    else:
        fixtures.write_c4_tfds(str(tmp_path / "tfds"), {"validation": C4_DOCS})
        data = f"terra.data.c4_source.tfds_data_dir = {str(tmp_path / 'tfds')!r}"
    # 64-token chunks here, so that a few short documents make several full ones.
    parsing.parse_gin(
        ["tasks/c4_span_corruption_paper.gin"],
        [
            data,
            f"terra.data.text_vocabulary.spm_path = {vocabulary_path!r}",
            "terra.data.c4_span_corruption_paper.chunk_length = 64",
        ],
    )
    task = tasks.get_task("c4_span_corruption_paper")
    vocabulary = task.output_features["targets"].vocabulary
    assert vocabulary.vocab_size == 1000  # the SentencePiece model's own ids: no sentinel ids added
    documents = [vocabulary.encode(doc) for doc in C4_DOCS]
    real = max(max(doc) for doc in documents)  # ids above it are sentinels
    examples = list(
        task.get_dataset({"inputs": 64, "targets": 32}, split="validation", shuffle=False, seed=0).as_numpy_iterator()
    )
    chunks = []
    for example in examples:
        inputs, targets = example["inputs"].tolist(), example["targets"].tolist()
        assert inputs[-1] == targets[-1] == 1  # EOS
        sentinels = [t for t in targets if t > real]
        assert sentinels == list(range(999, 999 - len(sentinels), -1))  # from the top piece down
        spans, current = {}, None
        for token in targets[:-1]:
            if token > real:
                current = spans.setdefault(token, [])
            else:
                current.append(token)
        chunks.append([t for token in inputs[:-1] for t in (spans[token] if token > real else [token])])
    # Every example is one chunk of 64 tokens of a document (its last may be shorter), in order.
    expected = [doc[i : i + 64] for doc in documents for i in range(0, len(doc), 64)]
    assert sorted(map(tuple, chunks)) == sorted(map(tuple, expected))
    assert sum(len(chunk) == 64 for chunk in chunks) >= len(chunks) - len(documents)
    assert np.mean([len(chunk) for chunk in chunks]) > 48
