"""The model protocol and the Python API: plain constructors, families, pad-aware metrics,
``terra.build`` with generate / score / logits / summarize, and the gin registry's promises."""

import contextlib
import dataclasses
import importlib
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import terra
from terra import api
from terra.errors import ConfigError
from terra.gin_config import parsing, registration
from terra.models import (
    EncoderDecoderModel,
    EncoderDecoderTransformer,
    Model,
    Terraformer,
    TerraformerModel,
    TransformerConfig,
)
from terra.quantization import dequantize_params

from cheap_init_prng import init_key
from helpers import REPO_ROOT, TINY_COPY_MODEL, tiny_config

pytestmark = pytest.mark.usefixtures("fast_compile")

TINY_COPY = TINY_COPY_MODEL + ["TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 16}"]


@pytest.fixture(scope="module")
def copy_model():
    """A fresh tiny encoder-decoder on the byte-vocabulary copy task, built from gin. Its
    parameters come from the model's initialisers with a key whose initializer compiles cheaply:
    what its tests read holds for any random parameters. Its tests decode 8 new tokens from 2 or
    3 rows where neither number is their subject: each decode length and batch shape compiles
    programs of its own, so the tests share a few."""
    run = terra.build(["models/tiny.gin", "tasks/synthetic_copy.gin"], TINY_COPY, random_weights=True)
    return dataclasses.replace(run, params=run.model.init_params(init_key(3)))


def test_plain_constructors_work_without_gin():
    default = EncoderDecoderModel()  # the paper's 800M baseline, abstractly
    assert default.config == TransformerConfig() and 700e6 < default.param_count()["total"] < 850e6
    assert isinstance(default, Model)
    assert isinstance(EncoderDecoderTransformer().config, TransformerConfig)
    terraformer = TerraformerModel(Terraformer(tiny_config()))
    assert isinstance(terraformer, Model)
    assert terraformer.params_read_per_token()["total"] < terraformer.param_count()["total"]


def test_a_family_refuses_another_familys_network():
    with pytest.raises(ConfigError, match="TerraformerModel"):
        EncoderDecoderModel(Terraformer(tiny_config()))


@pytest.mark.slow
def test_eval_metrics_and_scores_use_the_configured_pad_id(copy_model):
    model = EncoderDecoderModel(EncoderDecoderTransformer(dataclasses.replace(copy_model.config, pad_id=3)))
    # The pad id changes no parameter: the module's copy model's parameters fit this network.
    params = copy_model.params
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, model.abstract_params())
    targets = jnp.array([[5, 6, 7, 3], [8, 3, 3, 3]])
    batch = {"encoder_input_tokens": jnp.array([[4, 5, 6, 3], [7, 8, 3, 3]]), "decoder_target_tokens": targets}

    @jax.jit  # one program (as the trainer jits them), not one per operation of each call
    def measured(params, batch):
        sums = model.eval_metrics(params, batch)
        _, aux = model.loss_fn(params, batch)
        logp = jax.nn.log_softmax(model.logits(params, batch))
        nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * (targets != 3)
        return sums, aux, model.score(params, batch), -nll.sum(-1), model.decoder_input_tokens(batch)

    sums, aux, scores, minus_nll, decoder_inputs = measured(params, batch)
    assert float(sums["weight_sum"]) == 4.0 and float(sums["sequences"]) == 2.0
    np.testing.assert_allclose(aux["loss_sum"], sums["loss_sum"], rtol=1e-6)
    # The decoder starts from the pad id (3), and a row's score is minus its summed NLL.
    np.testing.assert_allclose(scores, minus_nll, rtol=1e-5)
    np.testing.assert_array_equal(decoder_inputs[:, 0], [3, 3])


@pytest.mark.slow
def test_build_generates_texts_from_texts_and_tokens_from_tokens(copy_model):
    texts = copy_model.generate(["abc", "hello world", "xyz"], max_new_tokens=8)
    assert isinstance(texts, list) and len(texts) == 3 and all(isinstance(t, str) for t in texts)
    tokens, _ = copy_model.tokens(["abc", "hello world", "xyz"])
    out = copy_model.generate(tokens, max_new_tokens=8)
    assert out.shape == (3, 8) and out.dtype == np.int32
    # Batched in chunks (the last one padded) equals all at once.
    np.testing.assert_array_equal(copy_model.generate(tokens, max_new_tokens=8, batch_size=2), out)
    assert copy_model.tokens([[5, 6], [7]])[0].tolist() == [[5, 6], [7, 0]]


def test_score_is_the_teacher_forced_log_likelihood(copy_model):
    inputs, targets = ["abc", "xyz"], ["abc", "xy"]
    scores = copy_model.score(inputs, targets)
    logits = copy_model.logits(inputs, targets)
    decoder_targets, _ = copy_model.tokens(targets, "targets")
    assert logits.shape == (2, decoder_targets.shape[1], copy_model.config.vocab_size)
    logp = jax.nn.log_softmax(logits)
    picked = np.take_along_axis(np.asarray(logp), decoder_targets[..., None], -1)[..., 0] * (decoder_targets != 0)
    np.testing.assert_allclose(scores, picked.sum(-1), rtol=1e-5)
    assert scores.shape == (2,) and np.all(scores < 0)


def test_summarize_refuses_a_task_that_is_not_summarization(copy_model):
    with pytest.raises(ConfigError, match="not summarization"):
        copy_model.summarize(["some text"])
    assert len(copy_model.summarize(["some text", "more text"], force=True, max_new_tokens=8)) == 2


def test_bad_token_inputs_fail_clearly(copy_model):
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        copy_model.generate([[1, 999]])
    with pytest.raises(ConfigError, match="non-empty"):
        copy_model.generate([])


def test_generate_rejects_sampling_options_with_beams(copy_model):
    with pytest.raises(ValueError, match="beam search is deterministic"):
        copy_model.generate(["abc"], num_beams=2, temperature=0.5)


def test_texts_beyond_the_feature_length_warn_once_refuse_or_cut_silently(copy_model):
    long_text = "abcdefgh" * 8  # 64 bytes: the copy task's inputs and targets hold 16
    fresh = dataclasses.replace(copy_model)
    with pytest.warns(UserWarning, match=r"1 inputs text\(s\) exceed the task's inputs length \(text 1: 64 tokens"):
        first, _ = fresh.tokens(["abc", long_text])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model and feature
        again, _ = fresh.tokens(["abc", long_text])
        quiet, _ = dataclasses.replace(copy_model).tokens(["abc", long_text], truncate=True)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, quiet)
    assert first.shape == (2, 16)
    with pytest.raises(ConfigError, match="exceed the task's targets length.*truncate=True"):
        copy_model.score(["abc"], [long_text], truncate=False)


def test_generate_shows_progress_over_the_inputs_when_asked(copy_model, capsys):
    quiet = copy_model.generate(["abc", "de", "fgh"], max_new_tokens=8, batch_size=2)
    assert capsys.readouterr().err == ""
    shown = copy_model.generate(["abc", "de", "fgh"], max_new_tokens=8, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert shown == quiet and "generate" in err and "3/3" in err and "input/s" in err


def test_empty_texts_and_no_new_tokens_are_refused(copy_model):
    with pytest.raises(ConfigError, match="inputs text 1 is empty"):
        copy_model.generate(["abc", "  "])
    with pytest.raises(ConfigError, match="targets text 0 is empty"):
        copy_model.score(["abc"], [""])
    for bad in (0, -3, 2.5):
        with pytest.raises(ConfigError, match="max_new_tokens must be a whole number of at least 1"):
            copy_model.generate(["abc"], max_new_tokens=bad)
    with pytest.raises(ConfigError, match="batch_size must be"):
        copy_model.generate(["abc"], batch_size=0)


def test_step_numbers_are_read_from_strings_and_odd_steps_refused():
    assert api._step_number("100") == 100 and api._step_number(7) == 7 and api._step_number(None) is None
    for bad in ("latest", "1.5", True):
        with pytest.raises(ConfigError, match="step must be a checkpoint's step number"):
            api._step_number(bad)


@pytest.mark.slow
def test_build_takes_one_gin_file_as_a_string():
    # Random weights: the parameters' values are not the subject, and drawing them compiles nothing.
    run = terra.build("models/tiny.gin", "TransformerConfig.d_ff = 96", random_weights=True)
    assert run.config.d_ff == 96 and run.task is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: terra.build("models/tiny.gin", {"TransformerConfig.d_ff": 96}), "bindings must be gin binding"),
        (lambda: terra.build("models/tiny.gin", None), "bindings must be a string or a list of strings"),
        (lambda: terra.build("models/tiny.gin", 96), "bindings must be a string or a list of strings"),
        (lambda: terra.build(None), "gin_files must be a string or a list of strings"),
        (lambda: terra.build("models/tiny.gin", seed=1.5), "seed must be a whole number, e.g. 0, not float"),
        (lambda: terra.build("models/tiny.gin", seed="3"), "seed must be a whole number"),
        (lambda: terra.load(None), "model_dir must be a run's folder"),
        (lambda: terra.load("runs/nowhere", bindings={"a": 1}), "bindings must be gin binding strings"),
    ],
    ids=["dict", "None", "int", "no-gin-files", "float-seed", "text-seed", "load-None", "load-dict"],
)
def test_build_and_load_name_the_argument_of_the_wrong_form(call, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        call()


def _fake_tensorflow(folder, body):
    package = folder / "tensorflow"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'oneDNN custom operations are on\\n')\n"
        "os.write(2, b'Could not find cuda drivers on your machine\\n')\n" + body
    )


def test_the_api_imports_tensorflow_without_its_start_up_lines(tmp_path, monkeypatch, capfd):
    """What ``terra.load`` of a run with a task does first (``api._tasks``): TensorFlow's C++
    start-up lines, printed before its log level applies, are not shown; they are if it fails."""
    from terra import tensorflow_setup

    calls = []
    quiet = tensorflow_setup.import_tensorflow_quietly
    monkeypatch.setattr(tensorflow_setup, "import_tensorflow_quietly", lambda: calls.append(quiet()))
    api._tasks()
    assert calls == [None]
    _fake_tensorflow(tmp_path, "class config:\n    set_visible_devices = staticmethod(lambda devices, kind: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorflow")
    capfd.readouterr()
    quiet()
    assert sys.modules["tensorflow"].__file__.startswith(str(tmp_path))
    assert "oneDNN" not in capfd.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    _fake_tensorflow(broken, "raise ImportError('no libtensorflow')\n")
    monkeypatch.syspath_prepend(str(broken))
    monkeypatch.delitem(sys.modules, "tensorflow")
    with pytest.raises(ImportError, match="no libtensorflow"):
        quiet()
    assert "Could not find cuda drivers" in capfd.readouterr().err  # a failed import shows why


def test_a_saved_model_opens_with_load_as_it_was_narrow_weights_kept_narrow(copy_model, tmp_path):
    tokens, _ = copy_model.tokens(["abc", "hello world"])
    # One program, not one per parameter shape.
    scaled = jax.jit(lambda params: jax.tree.map(lambda p: p * 1.5, params))(copy_model.params)
    changed = dataclasses.replace(copy_model, params=scaled)
    path = changed.save(tmp_path / "saved")  # parameters changed in a notebook are saved as changed
    assert path == str(tmp_path / "saved") and sorted(os.listdir(path)) == ["checkpoints", "config.gin"]
    loaded = terra.load(path)
    assert (loaded.step, loaded.task_name, loaded.weights_dtype, loaded.model_dir) == (
        0,
        "synthetic_copy",
        "float32",
        path,
    )
    jax.tree.map(np.testing.assert_array_equal, loaded.params, changed.params)
    np.testing.assert_array_equal(loaded.generate(tokens, max_new_tokens=8), changed.generate(tokens, max_new_tokens=8))
    narrow = copy_model.quantized("int8")
    reopened = terra.load(narrow.save(tmp_path / "int8"))  # stored as int8, opened as int8
    assert reopened.weights_dtype == "int8"
    jax.tree.map(np.testing.assert_array_equal, reopened.params, narrow.params)
    np.testing.assert_array_equal(
        reopened.generate(tokens, max_new_tokens=8), narrow.generate(tokens, max_new_tokens=8)
    )
    with pytest.raises(ConfigError, match="stores int8 weights .* open it with weights_dtype='int8'"):
        terra.load(tmp_path / "int8", weights_dtype="bfloat16")
    with pytest.raises(ConfigError, match="saved.* exists and is not an empty folder"):
        copy_model.save(tmp_path / "saved")
    os.symlink(tmp_path / "int8", tmp_path / "link")  # a link to a folder is not a new folder
    with pytest.raises(ConfigError, match="link exists and is not an empty folder"):
        copy_model.save(tmp_path / "link")
    outcomes = []

    def save_twice_at_once():
        try:
            outcomes.append(copy_model.save(tmp_path / "raced"))
        except ConfigError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=save_twice_at_once) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert str(tmp_path / "raced") in outcomes and any("save into a new folder" in o for o in outcomes), outcomes
    assert sorted(os.listdir(tmp_path)) == ["int8", "link", "raced", "saved"]  # no staging folder left beside them


def test_two_threads_building_at_once_keep_their_own_configs(monkeypatch):
    # Thread A pauses inside its build, after parsing; without the lock, thread B's parse would
    # replace A's bindings in gin's global config while A still reads them.
    real_build_model = parsing.build_model
    a_is_building = threading.Event()

    def build_model(*args, **kwargs):
        if threading.current_thread().name == "A":
            a_is_building.set()
            time.sleep(0.5)
        return real_build_model(*args, **kwargs)

    monkeypatch.setattr(parsing, "build_model", build_model)
    built, errors = {}, []

    def build(d_ff):
        try:
            # Random weights (drawn leaf by leaf from each model's abstract tree, inside the same
            # lock): the widths are the subject, and drawing them compiles nothing.
            built[threading.current_thread().name] = terra.build(
                "models/tiny.gin", f"TransformerConfig.d_ff = {d_ff}", random_weights=True
            )
        except Exception as error:  # surfaced below
            errors.append(error)

    a = threading.Thread(target=build, args=(96,), name="A")
    a.start()
    assert a_is_building.wait(60)
    b = threading.Thread(target=build, args=(160,), name="B")
    b.start()
    a.join()
    b.join()
    assert not errors
    assert built["A"].config.d_ff == 96 and built["B"].config.d_ff == 160
    widths = {name: {d for leaf in jax.tree.leaves(run.params) for d in leaf.shape} for name, run in built.items()}
    assert 96 in widths["A"] and 160 not in widths["A"] and 160 in widths["B"]


@pytest.mark.slow
def test_quantized_weights_generate_score_and_beam_search_as_their_dequantized_float32_weights(copy_model):
    narrow = copy_model.quantized("int8")
    assert narrow.weights_dtype == "int8" and "int8 weights" in repr(narrow)
    # One program, not one per parameter shape.
    wide = dataclasses.replace(copy_model, params=jax.jit(dequantize_params)(narrow.params))
    np.testing.assert_allclose(
        narrow.score(["abc", "xyz"], ["abc", "xy"]), wide.score(["abc", "xyz"], ["abc", "xy"]), rtol=1e-5
    )
    tokens, _ = copy_model.tokens(["abc", "hello world"])
    for options in ({}, {"num_beams": 2}):
        np.testing.assert_array_equal(
            narrow.generate(tokens, max_new_tokens=8, **options), wide.generate(tokens, max_new_tokens=8, **options)
        )
    assert copy_model.quantized("float32") is copy_model
    with pytest.raises(ConfigError, match="already int8"):
        narrow.quantized("bfloat16")
    with pytest.raises(ConfigError, match="weights_dtype 'int4' is not one of float32, bfloat16, int8"):
        terra.build(["models/tiny.gin"], weights_dtype="int4")


@pytest.mark.slow
def test_timed_generation_decodes_what_generate_does_and_reports_each_batch(copy_model):
    # A copy with its own compiled timed loops: its first batch compiles, whatever the module's
    # other tests timed.
    run = dataclasses.replace(copy_model)
    tokens, _ = run.tokens(["abc", "hello world", "xyz"])
    reports = []
    timed = run.generate(tokens, max_new_tokens=8, batch_size=2, timing=reports.append)
    np.testing.assert_array_equal(timed, run.generate(tokens, max_new_tokens=8, batch_size=2))
    phases = [(t["batch"], t["phase"]) for t in reports]
    assert phases == [(0, "compiled"), (0, "prefilled"), (0, "generated"), (1, "prefilled"), (1, "generated")]
    times = [t for t in reports if t["phase"] == "generated"]
    assert [t["batch"] for t in times] == [0, 1] and [t["rows"] for t in times] == [2, 1]
    assert times[0]["input_tokens"] == int(np.sum(tokens[:2] != 0)) and times[0]["input_length"] == tokens.shape[1]
    assert times[0]["compile_s"] > 0 and times[1]["compile_s"] == 0  # one shape: compiled once, untimed
    assert all(t["prefill_s"] > 0 and t["loop_s"] > 0 and 1 <= t["steps"] <= 8 for t in times)
    sampled = dict(max_new_tokens=8, temperature=0.7, seed=5)
    np.testing.assert_array_equal(run.generate(tokens, timing=times.append, **sampled), run.generate(tokens, **sampled))
    everything = []
    run.generate(tokens[:2], max_new_tokens=8, stop_at_eos=False, timing=everything.append)
    assert everything[-1]["steps"] == 8  # EOS or not
    with pytest.raises(ConfigError, match="num_beams=1"):
        run.generate(tokens, num_beams=2, timing=times.append)


def _joined_by_row(pieces, rows):
    joined = [[] for _ in range(rows)]
    for row, piece in pieces:
        joined[row].append(piece)
    return joined


def test_streamed_pieces_are_what_generate_returns_row_by_row(copy_model):
    texts = ["abc", "hello world", "xyz"]
    for options in (dict(max_new_tokens=8), dict(max_new_tokens=8, temperature=0.9, seed=4)):
        want = copy_model.generate(texts, batch_size=2, **options)
        pieces = list(copy_model.stream(texts, batch_size=2, **options))
        assert ["".join(row) for row in _joined_by_row(pieces, 3)] == want
        assert all(isinstance(row, int) and isinstance(piece, str) for row, piece in pieces)
    tokens, _ = copy_model.tokens(texts)
    want = copy_model.generate(tokens, max_new_tokens=8)
    got = _joined_by_row(copy_model.stream(tokens, max_new_tokens=8), 3)
    for row, ids in zip(want, got):  # each token id up to the row's EOS
        assert ids == [int(t) for t in row[: (list(row) + [1]).index(1)]]
    # The timed loop (timing, stop_at_eos=False) streams what it returns, through its own program.
    streamed = []
    timed = copy_model.generate(
        tokens, max_new_tokens=8, stop_at_eos=False, streamer=lambda row, token: streamed.append((row, token))
    )
    for row, ids in zip(timed, _joined_by_row(streamed, 3)):
        assert ids == [int(t) for t in row[: (list(row) + [1]).index(1)]]


@pytest.mark.parametrize("native", [True, False])
def test_the_stream_is_read_by_the_native_queue_or_called_back_from_the_loop(copy_model, native):
    """With the native kernels the loop queues its tokens and a reader thread hands them over
    (the loop never waits for Python); without them an io_callback does, between steps."""
    from terra.backends import native_kernels

    tokens, _ = copy_model.tokens(["abc", "hello world"])
    threads, got = set(), []

    def receive(row, token):
        threads.add(threading.current_thread().name)
        got.append((row, token))

    max_new_tokens = 9 if native else 7  # each its own decoder, traced with its own hand-over
    with contextlib.nullcontext() if native else native_kernels.disabled():
        want = copy_model.generate(tokens, max_new_tokens=max_new_tokens, stop_at_eos=False)
        copy_model.generate(tokens, max_new_tokens=max_new_tokens, stop_at_eos=False, streamer=receive)
    for row, ids in zip(want, _joined_by_row(got, 2)):
        assert ids == [int(t) for t in row[: (list(row) + [1]).index(1)]]
    if native and not native_kernels.available():
        native = False  # the library is not built: the loop calls back
    assert (threads == {"terra-stream-reader"}) == native, threads


def test_the_loops_controls_choose_as_hugging_faces_processors_and_scores_are_log_probabilities(copy_model):
    tokens, _ = copy_model.tokens(["abc", "hello world"])
    plain, scores = copy_model.generate(tokens, max_new_tokens=10, return_scores=True)
    np.testing.assert_array_equal(plain, copy_model.generate(tokens, max_new_tokens=10))  # scores change no choice
    log_probs = np.asarray(jax.nn.log_softmax(copy_model.logits(tokens, plain), axis=-1))
    for r, row_scores in enumerate(scores):  # the model's log-probability of each token, EOS included
        n = len(row_scores)
        np.testing.assert_allclose(row_scores, log_probs[r, np.arange(n), plain[r, :n]], atol=2e-5)
    # Each token is the argmax of the teacher-forced logits after the CTRL penalty of the tokens
    # before it (no row of this model stops before 10 tokens).
    penalized = copy_model.generate(tokens, max_new_tokens=10, repetition_penalty=1.3)
    logits = np.asarray(copy_model.logits(tokens, penalized))
    for r in range(len(penalized)):
        for t in range(10):
            seen = np.isin(np.arange(logits.shape[-1]), penalized[r, :t])
            want = np.where(seen, np.where(logits[r, t] > 0, logits[r, t] / 1.3, logits[r, t] * 1.3), logits[r, t])
            assert int(np.argmax(want)) == penalized[r, t], (r, t)
    banned = copy_model.generate(tokens, max_new_tokens=10, no_repeat_ngram_size=2)
    for row in banned:
        bigrams = list(zip(row[:-1], row[1:]))
        assert len(set(bigrams)) == len(bigrams), row
    assert not np.array_equal(banned, plain)  # the plain rows repeat bigrams
    with pytest.raises(ConfigError, match="no_repeat_ngram_size=9 must be a whole number from 0"):
        copy_model.generate(tokens, no_repeat_ngram_size=9)
    with pytest.raises(ConfigError, match="num_beams=1"):
        copy_model.generate(tokens, num_beams=2, repetition_penalty=1.2)


def test_several_sampled_outputs_per_input_and_stop_strings(copy_model):
    tokens, _ = copy_model.tokens(["abc", "hello world"])
    sampled = dict(max_new_tokens=8, temperature=1.0, seed=2)
    three = copy_model.generate(tokens, num_return_sequences=3, **sampled)
    np.testing.assert_array_equal(three, copy_model.generate(np.repeat(tokens, 3, axis=0), **sampled))
    assert len({tuple(row) for row in three[:3]}) > 1  # an input's outputs are sampled apart
    with pytest.raises(ConfigError, match="set temperature > 0"):
        copy_model.generate(tokens, num_return_sequences=2)
    texts = ["abc", "hello world"]
    whole = copy_model.generate(texts, max_new_tokens=10)
    stop = whole[1][1]  # a character the second output has, after its first
    cut = copy_model.generate(texts, max_new_tokens=10, stop_strings=[stop])
    assert cut[1] == whole[1][: whole[1].index(stop) + 1]
    assert cut[0] == (whole[0][: whole[0].index(stop) + 1] if stop in whole[0] else whole[0])
    pieces = _joined_by_row(copy_model.stream(texts, max_new_tokens=10, stop_strings=[stop]), 2)
    assert ["".join(row) for row in pieces] == cut
    with pytest.raises(ConfigError, match="give texts"):
        copy_model.generate(tokens, stop_strings=["x"])


def test_a_streamer_that_raises_ends_the_decode_and_its_error_is_raised(copy_model):
    tokens, _ = copy_model.tokens(["abc", "hello world", "xyz"])
    handed = []

    def one_token_then_fail(row, token):
        handed.append(token)
        raise BrokenPipeError("the reader went away")

    with pytest.raises(BrokenPipeError, match="went away"):
        copy_model.generate(tokens, max_new_tokens=8, stop_at_eos=False, streamer=one_token_then_fail)
    assert len(handed) == 1  # the loop ended at the step whose token failed, its other rows not handed over
    with pytest.raises(ConfigError, match="num_beams=1"):
        copy_model.generate(tokens, num_beams=2, streamer=print)


def test_leaving_a_stream_early_ends_its_decode_thread(copy_model):
    tokens, _ = copy_model.tokens(["abc", "hello world"])
    stream = copy_model.stream(tokens, max_new_tokens=12, stop_at_eos=False)
    first = next(stream)
    stream.close()  # what a `break` out of the for loop does
    assert first[0] in (0, 1)
    assert not [t for t in threading.enumerate() if t.name.startswith("terra-stream")]  # nor its reader
    with pytest.raises(ConfigError, match="at least 1"):
        next(copy_model.stream(tokens, max_new_tokens=0))


@pytest.mark.slow
def test_random_weights_are_drawn_leaf_by_leaf_and_stored_narrow():
    run = terra.build(["models/tiny.gin", "tasks/synthetic_copy.gin"], TINY_COPY, random_weights=True)
    assert run.weights_dtype == "float32" and run.task is not None
    kernels = [x for x in jax.tree.leaves(run.params) if x.ndim == 2]
    # Read on the host: eager jnp operations would compile a program per kernel shape.
    assert all(float(np.max(np.abs(np.asarray(k)))) <= np.sqrt(3.0 / k.shape[-1]) + 1e-6 for k in kernels)
    narrow = terra.build(
        ["models/tiny.gin", "tasks/synthetic_copy.gin"], TINY_COPY, weights_dtype="int8", random_weights=True
    )
    assert narrow.weights_dtype == "int8" and any(x.dtype == jnp.int8 for x in jax.tree.leaves(narrow.params))
    assert narrow.generate(["abc"], max_new_tokens=3, stop_at_eos=False) is not None
    with pytest.raises(ConfigError, match="not summarization"):
        terra.build(
            ["models/tiny.gin", "tasks/synthetic_copy.gin"], TINY_COPY, random_weights=True, require_summarization=True
        )


def test_cache_dtype_binds_the_models_cache_store():
    with pytest.raises(ConfigError, match="cache_dtype 'int4' is not one of float32, bfloat16, int8"):
        terra.build(["models/tiny.gin"], cache_dtype="int4")
    # Random weights: the binding is the subject, and drawing them compiles nothing.
    assert terra.build(["models/tiny.gin"], cache_dtype="int8", random_weights=True).config.cache_dtype == "int8"
    assert terra.build(["models/tiny.gin"], random_weights=True).config.cache_dtype == "float32"


def _registered_terra_configurables():
    import gin

    return {selector: c for selector, c in gin.config._REGISTRY.items() if selector.startswith("terra.")}


def test_the_registration_module_lists_every_terra_configurable_gin_knows():
    # terra/gin_config/registry.json is written from this list, not from gin's private registry.
    listed = registration.registered()
    known = _registered_terra_configurables()
    assert sorted(listed) == sorted(known)
    assert all(listed[selector] is known[selector].wrapped for selector in listed)


def test_every_terra_gin_name_resolves_by_import_to_its_object():
    problems = []
    for selector, configurable in _registered_terra_configurables().items():
        module_name, _, attr = selector.rpartition(".")
        found = getattr(importlib.import_module(module_name), attr, None)
        if found is None or found not in (configurable.wrapper, configurable.wrapped):
            problems.append(selector)
    assert not problems, f"gin names that do not resolve by import: {problems}"


def test_every_terra_name_in_the_shipped_gin_files_is_registered():
    # registered() registers the data layer too (whichever tests ran before in this process).
    registered = set(registration.registered())
    used = set()
    for root, _, files in os.walk(os.path.join(REPO_ROOT, "configs")):
        for name in files:
            with open(os.path.join(root, name)) as f:
                text = "\n".join(line for line in f if not line.lstrip().startswith(("#", "import ")))
            used |= set(re.findall(r"\b(terra(?:\.\w+)+)", text))
    unknown = [u for u in sorted(used) if u not in registered and u.rpartition(".")[0] not in registered]
    assert not unknown, f"gin files name unregistered terra configurables: {unknown}"


@pytest.mark.slow
def test_importing_any_module_after_parsing_registers_nothing_new():
    """What makes ``terra.load``/``terra.build`` safe in a notebook: after ``terra.gin_config.registration``
    has registered every name (parsing imports it), importing every terra module adds no
    configurable, so none can hit gin's lock."""
    script = (
        "import gin, importlib, pkgutil, terra\n"
        "from terra.gin_config import parsing\n"
        "parsing.parse_gin(['models/tiny.gin'])\n"
        "before = {s for s, _ in gin.config._REGISTRY.items()}\n"
        "for m in pkgutil.walk_packages(terra.__path__, 'terra.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "added = {s for s, _ in gin.config._REGISTRY.items()} - before\n"
        "assert not added, added\n"
        "print('ok')\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
