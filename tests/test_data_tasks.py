"""terra.data.tasks: what each task trains (its objective, from the registry, without building
it) and the check that a model's vocabulary and length fit a task."""

import re

import pytest
import seqio

from terra.data import tasks
from terra.errors import ConfigError


def test_every_task_has_one_of_the_objectives():
    assert set(tasks.TASK_OBJECTIVES) == set(tasks.TASK_BUILDERS)
    for name in tasks.TASK_BUILDERS:
        assert tasks.task_objective(name) in tasks.OBJECTIVES, name
    assert set(tasks.OBJECTIVES) == {"summarization", "span_corruption", "prefix_lm", "synthetic"}


@pytest.mark.parametrize(
    "name, objective",
    [
        ("arxiv_summarization", "summarization"),
        ("embedded_summarization", "summarization"),
        ("c4_span_corruption", "span_corruption"),
        ("c4_single_word_masking", "span_corruption"),
        ("embedded_span_corruption", "span_corruption"),
        ("c4_lm", "prefix_lm"),
        ("embedded_lm", "prefix_lm"),
        ("synthetic_copy", "synthetic"),
        ("synthetic_addition", "synthetic"),
    ],
)
def test_task_objectives(name, objective):
    assert tasks.task_objective(name) == objective
    assert tasks.is_summarization(name) == (objective == "summarization")


def test_the_objective_comes_from_the_registry_not_the_name(monkeypatch):
    # A summarization task whose name says nothing, and a name that says summarization but is not.
    monkeypatch.setitem(tasks.TASK_BUILDERS, "papers_v2", tasks.TASK_BUILDERS["arxiv_summarization"])
    monkeypatch.setitem(tasks.TASK_OBJECTIVES, "papers_v2", "summarization")
    monkeypatch.setitem(tasks.TASK_BUILDERS, "summarization_as_lm", tasks.TASK_BUILDERS["embedded_lm"])
    monkeypatch.setitem(tasks.TASK_OBJECTIVES, "summarization_as_lm", "prefix_lm")
    assert tasks.is_summarization("papers_v2") and not tasks.is_summarization("summarization_as_lm")
    monkeypatch.setitem(tasks.TASK_BUILDERS, "unclassified", tasks.TASK_BUILDERS["embedded_lm"])
    with pytest.raises(ConfigError, match="task 'unclassified' has no objective; add it to .*TASK_OBJECTIVES"):
        tasks.task_objective("unclassified")


def test_built_tasks_and_mixtures_have_the_objectives_of_their_names():
    copy = tasks.get_task("synthetic_copy")
    assert isinstance(copy, seqio.Task) and tasks.task_objective(copy) == "synthetic"
    mixture = tasks.get_task("synthetic")
    assert isinstance(mixture, seqio.Mixture)
    assert tasks.task_objective(mixture) == tasks.task_objective("synthetic") == "synthetic"
    assert not tasks.is_summarization(mixture)


def test_a_mixture_of_different_objectives_is_a_mixture(monkeypatch):
    monkeypatch.setitem(tasks.MIXTURES, "papers_and_c4", ("arxiv_summarization", "c4_span_corruption"))
    monkeypatch.setitem(tasks.MIXTURES, "two_summaries", ("arxiv_summarization", "embedded_summarization"))
    assert tasks.task_objective("papers_and_c4") == "mixture" and not tasks.is_summarization("papers_and_c4")
    assert tasks.task_objective("two_summaries") == "summarization" and tasks.is_summarization("two_summaries")
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
        tasks.task_objective("arxiv_summarisation")
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
    tasks.check_vocabulary_and_lengths("synthetic", {"inputs": 8, "targets": 8}, vocab_size=512, max_len=8)


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
    # The vocabulary is checked first, as the trainer's check does.
    with pytest.raises(ConfigError, match=re.escape("bind TransformerConfig.vocab_size = 259")):
        tasks.check_vocabulary_and_lengths(copy, {"inputs": 100, "targets": 130}, vocab_size=10, max_len=64)
