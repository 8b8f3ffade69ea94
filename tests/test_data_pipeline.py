"""Tasks, feature converters and batches: every shipped task config builds its task, streams are
deterministic, resumable and sharded per host, and the batches feed the model's loss."""

import glob
import os

import gin
import jax
import numpy as np
import pytest
import seqio

from terra.benchmarks.decode_speed import random_params
from terra.cli import data as data_cli
from terra.cli import flag_groups
from terra.data import feature_converters, fixtures, pipeline, tasks
from terra.errors import ConfigError, DataNotFoundError
from terra.gin_config import parsing
from terra.models import EncoderDecoderModel, EncoderDecoderTransformer

# XLA's optimizations only cost compile time at these sizes (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

TASK_CONFIGS = sorted(glob.glob(os.path.join(parsing.CONFIGS_DIR, "tasks", "*.gin")))
DOCS = [f"Document {i}: sparse layers make decoding fast. " * 8 for i in range(40)]


@pytest.fixture(scope="module")
def c4_json_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("c4"))
    fixtures.write_c4_json(root, {"train": DOCS, "validation": DOCS[:4]}, shards=2)
    return root


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("path", TASK_CONFIGS, ids=os.path.basename)
@pytest.mark.slow
def test_every_task_config_builds_its_task(path):
    parsing.parse_gin([path], [])
    name = gin.query_parameter("%TASK")
    lengths = gin.query_parameter("%TASK_FEATURE_LENGTHS")
    task = tasks.get_task(name)
    assert task.name == name and name in seqio.TaskRegistry.names()
    assert set(lengths) == {"inputs", "targets"}
    assert isinstance(gin.query_parameter("%FEATURE_CONVERTER").scoped_configurable_fn(), seqio.FeatureConverter)


@pytest.mark.slow
def test_registration_is_idempotent_and_names_are_stable():
    names = tasks.register_all()
    assert tasks.register_all() == names
    for expected in (
        "c4_span_corruption",
        "c4_lm",
        "arxiv_summarization",
        "synthetic_copy",
        "synthetic_addition",
        "embedded_lm",
        "embedded_summarization",
        "synthetic",
    ):
        assert expected in names
    assert isinstance(tasks.get_task("synthetic"), seqio.Mixture)


def test_unknown_task_suggests_the_closest_name():
    with pytest.raises(ConfigError, match="Did you mean 'c4_span_corruption'"):
        tasks.get_task("c4_span_coruption")


def test_data_flags_bind_the_sources(c4_json_dir):
    parsing.parse_gin([], flag_groups.data_bindings({"c4_json": c4_json_dir, "tfds_data_dir": "/x"}))
    task = tasks.get_task("c4_span_corruption")
    assert len(task.source.list_shards("train")) == 2
    assert tasks.arxiv_source().data_dir == "/x"


@pytest.mark.slow
def test_c4_span_corruption_batches_from_json_shards_have_the_feature_lengths(c4_json_dir):
    parsing.parse_gin([], [f"terra.data.c4_source.json_path = {c4_json_dir!r}"])
    ds = pipeline.get_dataset(  # unshuffled: no 1,000-example shuffle buffer to fill first
        tasks.get_task("c4_span_corruption"), feature_lengths={"inputs": 64, "targets": 16}, batch_size=2, shuffle=False
    )
    batch = next(pipeline.BatchIterator(ds))
    assert batch["encoder_input_tokens"].shape == (2, 64)
    assert batch["decoder_target_tokens"].shape == batch["decoder_loss_weights"].shape == (2, 16)
    vocab_size = tasks.get_task("c4_span_corruption").output_features["targets"].vocabulary.vocab_size
    assert (batch["decoder_target_tokens"] == vocab_size - 1).any()  # the first sentinel, <extra_id_0>
    np.testing.assert_array_equal(batch["decoder_loss_weights"], batch["decoder_target_tokens"] != 0)


@pytest.mark.parametrize("task", ["embedded_span_corruption", "c4_span_corruption"])
@pytest.mark.slow
def test_resuming_the_stream_at_step_k_gives_the_same_batches(task, c4_json_dir, tmp_path):
    parsing.parse_gin([], [f"terra.data.c4_source.json_path = {c4_json_dir!r}"])

    def stream():
        return pipeline.BatchIterator(
            pipeline.get_dataset(
                tasks.get_task(task), feature_lengths={"inputs": 32, "targets": 8}, batch_size=2, seed=3
            )
        )

    straight = stream()
    _take(straight, 3)
    state = straight.save(str(tmp_path / "data" / "step3"))
    expected = _take(straight, 4)
    resumed = stream()
    resumed.restore(state)
    _assert_same_batches(_take(resumed, 4), expected)
    with pytest.raises(FileNotFoundError, match="no saved input-pipeline state"):
        resumed.restore(str(tmp_path / "missing"))  # any stream: the path is checked before the state


@pytest.mark.slow
def test_the_same_seed_gives_the_same_stream_and_another_seed_differs():
    def first_batches(seed):
        it = pipeline.BatchIterator(
            pipeline.get_dataset(
                tasks.get_task("embedded_span_corruption"),
                feature_lengths={"inputs": 32, "targets": 8},
                batch_size=4,
                seed=seed,
            )
        )
        return _take(it, 2)

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    _assert_same_batches(a, b)
    assert any(not np.array_equal(x["encoder_input_tokens"], y["encoder_input_tokens"]) for x, y in zip(a, c))


@pytest.mark.slow
def test_each_host_reads_a_disjoint_shard():
    # An odd number of examples (not the 1,000 of the default), so the two shards differ in size.
    parsing.parse_gin([], ["terra.data.copy_dataset.num_eval_examples = 101"])

    def inputs(index):
        ds = pipeline.get_dataset(
            tasks.get_task("synthetic_copy"),
            split="validation",
            feature_lengths={"inputs": 160, "targets": 160},
            batch_size=1,
            shuffle=False,
            num_epochs=1,
            shard_info=seqio.ShardInfo(index, 2),
        )
        return [bytes(b["encoder_input_tokens"][0]) for b in pipeline.BatchIterator(ds)]

    everything = pipeline.get_dataset(
        tasks.get_task("synthetic_copy"),
        split="validation",
        feature_lengths={"inputs": 160, "targets": 160},
        batch_size=1,
        shuffle=False,
        num_epochs=1,
        shard_info=seqio.ShardInfo(0, 1),
    )
    total = sum(1 for _ in pipeline.BatchIterator(everything))
    assert total == 101
    host0, host1 = inputs(0), inputs(1)
    assert len(host0) + len(host1) == total and not set(host0) & set(host1)


def _first_addition_batch(batch_size, converter):
    """The first validation batch of the addition task at lengths 302/216, in order."""
    ds = pipeline.get_dataset(
        tasks.get_task("synthetic_addition"),
        split="validation",
        feature_lengths={"inputs": 302, "targets": 216},
        batch_size=batch_size,
        shuffle=False,
        num_epochs=1,
        feature_converter=converter,
    )
    return next(pipeline.BatchIterator(ds))


def test_length_concat_moves_the_input_padding_after_the_targets():
    parsing.parse_gin([], [])
    b = _first_addition_batch(2, feature_converters.length_concat_converter())
    for i in range(2):
        n = int(b["encoder_lengths"][i])
        assert n == int((b["encoder_input_tokens"][i] != 0).sum())
        concat = b["concat_input_tokens"][i]
        np.testing.assert_array_equal(concat[:n], b["encoder_input_tokens"][i][:n])
        np.testing.assert_array_equal(concat[n : n + 216], b["decoder_input_tokens"][i])
        assert not concat[n + 216 :].any()
        np.testing.assert_array_equal(b["concat_target_tokens"][i][n : n + 216], b["decoder_target_tokens"][i])
        weights = b["concat_loss_weights"][i]
        assert weights.sum() == b["decoder_loss_weights"][i].sum() and not weights[:n].any()


def test_lm_format_puts_the_loss_on_the_answer_only():
    b = _first_addition_batch(1, feature_converters.prefix_lm_converter())
    tokens, weights = b["decoder_target_tokens"][0], b["decoder_loss_weights"][0]
    vocab = tasks.get_task("synthetic_addition").output_features["targets"].vocabulary
    question = vocab.decode([int(t) for t in tokens[weights == 0] if t != 0])
    answer = vocab.decode([int(t) for t in tokens[weights == 1]])
    x, y = question.split("+")
    assert int(answer[::-1]) == int(x[::-1]) + int(y[::-1])  # little-endian digits


@pytest.mark.parametrize(
    "model_file, bindings",
    [("models/tiny.gin", ["TransformerConfig.n_encoder_layers = 0"]), ("models/tiny_terraformer.gin", [])],
    ids=["encoder-decoder without encoder layers", "terraformer"],
)
@pytest.mark.slow
def test_the_language_model_form_makes_both_model_families_causal_language_models(model_file, bindings):
    # The reference trains its Table 4 baseline as a language model over "0 w 0 w"; the
    # language-model converter feeds it to the encoder-decoder families with an empty encoder.
    parsing.parse_gin(
        [model_file, "tasks/synthetic_copy_digits_lm.gin"],
        [
            "TransformerConfig.vocab_size = 16",
            "terra.data.copy_dataset.eval_min_length = 5",
            "terra.data.copy_dataset.eval_max_length = 9",
            *bindings,
        ],
    )
    model = parsing.build_model()
    lengths = {"inputs": 10, "targets": 8}
    batch = next(
        pipeline.BatchIterator(
            pipeline.get_dataset(
                tasks.get_task("synthetic_copy_digits_lm"),
                feature_lengths=lengths,
                batch_size=4,
                split="validation",
                shuffle=False,
                feature_converter=gin.query_parameter("%FEATURE_CONVERTER").scoped_configurable_fn(),
            )
        )
    )
    # Causality and the loss's weights hold for any parameter values: random weights drawn by
    # numpy (the decode benchmark's), where the model's own initialiser compiles for seconds.
    params = random_params(model, seed=0)
    forward = jax.jit(model.logits)  # one compilation for both batches
    logits = np.asarray(forward(params, batch))
    assert logits.shape == (4, 18, 16)
    # Every position sees only the sequence before it: change the tokens after position t, and the
    # logits up to t stay; the next position's change.
    t = 7
    changed = dict(batch, decoder_input_tokens=batch["decoder_input_tokens"].copy())
    changed["decoder_input_tokens"][:, t + 1 :] = (changed["decoder_input_tokens"][:, t + 1 :] % 11) + 1
    other = np.asarray(forward(params, changed))
    np.testing.assert_allclose(other[:, : t + 1], logits[:, : t + 1], atol=1e-5)
    assert np.abs(other[:, t + 1] - logits[:, t + 1]).max() > 1e-4
    # The loss counts the second w only.
    _, metrics = jax.jit(model.loss_fn)(params, batch)
    weights = batch["decoder_loss_weights"].sum()
    assert float(metrics["weight_sum"]) == weights < (batch["decoder_target_tokens"] != 0).sum()


def test_missing_task_data_fails_before_reading_with_the_path(tmp_path):
    parsing.parse_gin([], [f"terra.data.arxiv_source.tfds_data_dir = {str(tmp_path)!r}"])
    with pytest.raises(DataNotFoundError, match=str(tmp_path / "scientific_papers" / "arxiv" / "1.1.1")):
        pipeline.get_dataset(
            tasks.get_task("arxiv_summarization"), feature_lengths={"inputs": 64, "targets": 16}, batch_size=1
        )


def test_data_cli_prints_decoded_examples(capsys, c4_json_dir):
    assert (
        data_cli.call(
            [
                "show",
                "--task",
                "c4_span_corruption",
                "--c4_json",
                c4_json_dir,
                "--n",
                "2",
                "--inputs_length",
                "64",
                "--targets_length",
                "16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("--- example") == 4 and "<extra_id_0>" in out
    # What each split found, before the examples: no file is lost without a word.
    assert out.startswith(f"split train: 2 files, {len(DOCS)} records\nsplit validation: 2 files, 4 records\n"), out


@pytest.mark.slow
def test_summarization_batches_train_the_model(tiny_config_for_vocab):
    task = tasks.get_task("embedded_summarization")
    vocab_size = task.output_features["targets"].vocabulary.vocab_size
    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config_for_vocab(vocab_size)))
    params = random_params(model, seed=0)  # an untrained model, without compiling its initialiser
    lengths = {"inputs": 64, "targets": 16}
    # Unshuffled: any batch will do, and a shuffled stream first fills a 1,000-example buffer.
    batch = next(
        pipeline.BatchIterator(pipeline.get_dataset(task, feature_lengths=lengths, batch_size=2, shuffle=False))
    )
    loss, _ = jax.jit(model.loss_fn)(params, batch, None)
    assert np.isfinite(float(loss)) and float(loss) > np.log(vocab_size) * 0.5


@pytest.fixture
def tiny_config_for_vocab():
    from helpers import tiny_config

    return lambda vocab_size: tiny_config(vocab_size=vocab_size)


def test_train_vocab_reads_a_tasks_raw_text(c4_json_dir, tmp_path, capsys):
    from terra.cli import vocab as vocab_cli
    from terra.data import vocabularies

    out = tmp_path / "c4.model"
    argv = [
        "--task",
        "c4_span_corruption",
        "--c4_json",
        c4_json_dir,
        "--out",
        str(out),
        "--vocab_size",
        "300",
        "--nohard_vocab_limit",
    ]
    assert vocab_cli.main(argv) == 0
    vocab = vocabularies.sentencepiece_vocabulary(str(out))
    assert vocab.decode(vocab.encode(DOCS[0])) == DOCS[0]
    assert (
        vocab_cli.main(
            [
                "--task",
                "arxiv_summarization",
                "--tfds_data_dir",
                str(tmp_path / "none"),
                "--out",
                str(tmp_path / "a.model"),
            ]
        )
        == 2
    )
    assert "scientific_papers" in capsys.readouterr().err


@pytest.mark.slow
def test_input_pipeline_benchmark_prints_tokens_per_second(tmp_path, capsys):
    from terra.cli import bench

    out = tmp_path / "bench"
    # Unshuffled rows: a rate needs batches, not their order, and each shuffled row would first
    # fill a 1,000-example buffer.
    unshuffled = "--gin_bindings=terra.data.get_dataset.shuffle = False"
    argv = ["input", "--out", str(out), "--seconds", "0.001", "--copies", "1", "--batch_size", "1", unshuffled]
    assert bench.call(argv) == 0
    import json

    rows = json.loads((out / "input_pipeline.json").read_text())["rows"]
    assert [r["task"] for r in rows] == ["c4_span_corruption"] * 2 + ["arxiv_summarization"] * 2
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert "tokens/s" in (out / "input_pipeline.md").read_text() and "tokens/s" in capsys.readouterr().out


def test_a_dataset_built_without_autograph_traces_its_functions_as_written_or_falls_back():
    import tensorflow as tf

    from terra.data import graph_functions

    def python_if_on_a_tensor(x):
        if x > 2:  # needs AutoGraph: a tensor used as a Python bool
            return x * 10
        return x

    numbers = tf.data.Dataset.range(5)
    assert list(numbers.map(python_if_on_a_tensor).as_numpy_iterator()) == [0, 1, 2, 30, 40]
    with graph_functions.without_autograph(), pytest.raises(TypeError, match="bool"):
        numbers.map(python_if_on_a_tensor)
    assert list(numbers.map(python_if_on_a_tensor).as_numpy_iterator()) == [0, 1, 2, 30, 40]  # the switch is back
    # A pipeline with such a function (a user's preprocessor) is built again, with AutoGraph.
    built = graph_functions.build(lambda: numbers.map(python_if_on_a_tensor))
    assert list(built.as_numpy_iterator()) == [0, 1, 2, 30, 40]


@pytest.mark.parametrize(
    "task", ["c4_span_corruption", "c4_lm", "embedded_summarization", "synthetic_copy_digits", "synthetic_addition"]
)
@pytest.mark.slow
def test_batches_built_without_autograph_equal_those_autograph_converts(task, c4_json_dir, monkeypatch):
    import contextlib

    from terra.data import graph_functions

    parsing.parse_gin([], [f"terra.data.c4_source.json_path = {c4_json_dir!r}"])

    def first_batches():
        # Unshuffled: AutoGraph only rewrites the map and filter functions (the seeded random
        # preprocessors among them); shuffling first would fill a 1,000-example buffer per stream.
        stream = pipeline.get_dataset(
            tasks.get_task(task), feature_lengths={"inputs": 32, "targets": 8}, batch_size=2, seed=3, shuffle=False
        )
        return _take(stream.as_numpy_iterator(), 3)

    as_written = first_batches()
    # TensorFlow's default: every map and filter function rewritten by AutoGraph.
    monkeypatch.setattr(graph_functions, "without_autograph", contextlib.nullcontext)
    _assert_same_batches(first_batches(), as_written)
