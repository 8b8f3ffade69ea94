"""ROUGE through rouge-score, self-consistent decoding, terra-evaluate and terra-summarize end to end."""

import contextlib
import functools
import io
import json
import os
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rouge_score import rouge_scorer, scoring

import terra
from terra.cli import evaluate as evaluate_cli
from terra.cli import summarize
from terra.data import fixtures
from terra.errors import ConfigError, InputError, UsageError
from terra.evaluation import evaluator, rouge, summaries
from terra.gin_config import parsing
from terra.training import checkpointing, trainer

TARGETS = [
    "The model is sparse.\nIt decodes quickly on a CPU.",
    "Reversible layers save memory.",
    "LSH attention handles long inputs.\nThe SRU helps generalization.\nSummaries use ROUGE.",
]
PREDICTIONS = [
    "A sparse model decodes quickly.\nIt runs on CPUs.",
    "Reversible layers are memory efficient.",
    "Long inputs need LSH attention.\nROUGE scores summaries.",
]


# The module shares a fine-tuned run: the slow tier.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.slow]


def test_rouge_equals_rouge_score_called_directly():
    direct = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    ours = rouge.score_examples(TARGETS, PREDICTIONS)
    aggregator = scoring.BootstrapAggregator()
    for target, prediction, mine in zip(TARGETS, PREDICTIONS, ours):
        theirs = direct.score(target, prediction)
        assert mine == theirs
        aggregator.add_scores(theirs)
    np.random.seed(7)
    expected = aggregator.aggregate()
    corpus = rouge.corpus_rouge(TARGETS, PREDICTIONS, seed=7)
    for name in rouge.ROUGE_TYPES:
        assert corpus[name]["f1"] == pytest.approx(expected[name].mid.fmeasure, abs=1e-12)
        assert corpus[name]["f1_low"] == pytest.approx(expected[name].low.fmeasure, abs=1e-12)
        assert corpus[name]["recall"] == pytest.approx(expected[name].mid.recall, abs=1e-12)
    # Summary-level LCS uses the newlines: it differs from the sentence-level score here.
    assert corpus["rougeLsum"]["f1"] != corpus["rougeL"]["f1"]
    assert "ROUGE-LSum" in rouge.markdown_table(corpus, label="x")


@pytest.mark.slow
def test_greedy_decoding_equals_the_argmax_of_its_own_teacher_forced_logits(tiny_model):
    model, params = tiny_model
    inputs = jnp.asarray(np.random.RandomState(0).randint(2, model.config.vocab_size, (3, 9)), jnp.int32)
    out = model.generate(params, inputs, max_decode_length=8)

    @jax.jit  # one program, not one per operation of the forward pass
    def teacher_forced_argmax(params, inputs, tokens):
        return jnp.argmax(model.logits(params, {"encoder_input_tokens": inputs, "decoder_target_tokens": tokens}), -1)

    argmax = np.asarray(teacher_forced_argmax(params, inputs, jnp.asarray(out.tokens)))
    for row, length in enumerate(out.lengths):
        np.testing.assert_array_equal(argmax[row, :length], out.tokens[row, :length])


def test_sampling_is_reproducible_for_a_seed(tiny_model):
    model, params = tiny_model
    # Three rows padded to 9 tokens, 8 decoded: the greedy test's shapes, so one compiled decode serves both.
    rows = [np.arange(2, 9, dtype=np.int32), np.arange(5, 8, dtype=np.int32), np.arange(3, 12, dtype=np.int32)]

    def sample(seed):
        return summaries.generate_summaries(
            model, params, rows, input_length=9, batch_size=3, max_decode_length=8, temperature=1.0, seed=seed
        )

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def _papers(n, offset):
    topics = ["sparse layers", "reversible networks", "hashing attention", "recurrent units", "summaries"]
    papers = []
    for i in range(offset, offset + n):
        topic = topics[i % len(topics)]
        article = [f"we study {topic} in model {i} .", f"the {topic} make decoding fast .", "results are reported ."]
        abstract = [f"{topic} make decoding fast .", f"we report model {i} ."]
        papers.append(fixtures.cohan_record(i, article, abstract))
    return papers


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny model fine-tuned a few steps on a Cohan-format arXiv the test writes, with ROUGE
    measured during training and the best checkpoint kept by it. It starts from random weights
    drawn leaf by leaf, which compiles nothing (the model's initializer compiles for seconds):
    no test reads their values."""
    root = tmp_path_factory.mktemp("arxiv")
    cohan = fixtures.write_cohan(
        str(root), {"train": _papers(12, 0), "validation": _papers(5, 100), "test": _papers(3, 200)}
    )
    model_bindings = [
        f"terra.data.arxiv_source.cohan_path = {cohan!r}",
        "TransformerConfig.vocab_size = 4100",
        "TransformerConfig.d_model = 32",
        "TransformerConfig.d_ff = 64",
        "TransformerConfig.n_encoder_layers = 1",
        "TransformerConfig.n_decoder_layers = 1",
        "TASK_FEATURE_LENGTHS = {'inputs': 48, 'targets': 16}",
    ]
    gin_files = ["models/tiny.gin", "tasks/arxiv_summarization.gin"]
    pretrained = terra.build(gin_files, model_bindings, random_weights=True).save(root / "pretrained")
    model_dir = str(root / "run")
    parsing.parse_gin(
        [*gin_files, "runs/train.gin"],
        [
            *model_bindings,
            f"INIT_FROM = {pretrained!r}",
            f"MODEL_DIR = {model_dir!r}",
            "BATCH_SIZE = 8",
            "TRAIN_STEPS = 4",
            # SGD: its step compiles in about half Adafactor's time, and no test reads how the
            # parameters moved.
            "terra.training.Trainer.optimizer = @terra.training.sgd()",
            # In order: a shuffled stream fills its 1,000-example buffer before the first batch,
            # and no test reads which papers a step trained on.
            "terra.training.Trainer.shuffle = False",
            "terra.training.EvaluationSettings.every = 0",
            "terra.training.LoggingSettings.progress = False",
            "terra.training.LoggingSettings.every = 2",
            "terra.training.EvaluationSettings.hooks = [@terra.evaluation.RougeEvaluation()]",
            "terra.evaluation.RougeEvaluation.every = 2",
            "terra.evaluation.RougeEvaluation.examples = 3",
            "terra.training.CheckpointSettings.every = 2",
            "terra.training.CheckpointSettings.best_metric = 'eval/rougeLsum'",
            "terra.training.CheckpointSettings.keep_last = 1",
        ],
    )
    trainer.Trainer().run()
    return model_dir, cohan


@pytest.mark.slow
def test_fine_tuning_logs_rouge_and_keeps_the_best_checkpoint_by_it(finetuned):
    model_dir, _ = finetuned
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    scored = [r for r in rows if "eval/rougeLsum" in r]
    assert [r["step"] for r in scored] == [2, 4]
    assert all(0.0 <= r[f"eval/{name}"] <= 1.0 for r in scored for name in rouge.ROUGE_TYPES)
    assert os.path.exists(os.path.join(model_dir, "tensorboard"))
    # The scores are stored with the checkpoints, which are ranked by them.
    with checkpointing.Checkpointer(model_dir, best_metric="eval/rougeLsum", best_mode="max") as ckpt:
        assert ckpt.metrics(4)["eval/rougeLsum"] == scored[-1]["eval/rougeLsum"]


@pytest.fixture(scope="module")
def evaluated(finetuned, tmp_path_factory):
    """``(terra-evaluate's flags, its output folder, what it wrote to stderr)``: one float32
    evaluation of the fine-tuned run, shared by the module."""
    model_dir, cohan = finetuned
    out = tmp_path_factory.mktemp("evaluated") / "eval"
    common = ["--checkpoint", model_dir, "--batch_size", "2", "--max_decode_length", "6", f"--arxiv_cohan={cohan}"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert evaluate_cli.call([*common, "--output_dir", str(out)]) == 0
    return common, out, err.getvalue()


@pytest.mark.slow
def test_evaluate_writes_predictions_and_all_four_rouge_scores(evaluated, tmp_path):
    common, out, err = evaluated
    argv = [*common, "--output_dir", str(out)]
    assert "summaries: 100%" in err and "5/5" in err  # the progress bar over the examples, on stderr
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 5 and {"id", "input", "target", "prediction"} <= set(predictions[0])
    assert predictions[0]["target"] == "sparse layers make decoding fast .\nwe report model 100 ."
    assert [p["id"] for p in predictions] == [f"paper{i}" for i in range(100, 105)]  # the Cohan article ids
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["n_examples"] == 5 and np.isfinite(metrics["log_perplexity"])
    for name in rouge.ROUGE_TYPES:
        assert (
            0.0 <= metrics["rouge"][name]["f1_low"] <= metrics["rouge"][name]["f1"] <= metrics["rouge"][name]["f1_high"]
        )
    # The predictions are the model's greedy decode: a rerun with the same settings agrees.
    assert evaluate_cli.call(argv + ["--output_dir", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "predictions.jsonl").read_text() == (out / "predictions.jsonl").read_text()


def test_evaluate_stops_before_decoding_when_it_cannot_write_its_results(finetuned, tmp_path, monkeypatch):
    model_dir, cohan = finetuned
    (tmp_path / "taken").write_text("a file where the output folder would go")
    monkeypatch.setattr(evaluator, "decode_and_score", lambda *a, **k: pytest.fail("decoded before the check"))
    argv = ["--checkpoint", model_dir, f"--arxiv_cohan={cohan}", "--output_dir", str(tmp_path / "taken" / "eval")]
    with pytest.raises(ConfigError, match=r"cannot write the evaluation to .*taken/eval: Not a directory. Choose"):
        evaluate_cli.call(argv)


@pytest.mark.slow
def test_evaluate_and_summarize_read_int8_weights_beside_the_float32_results(finetuned, evaluated, tmp_path, capsys):
    model_dir, _ = finetuned
    common, float32_out, _ = evaluated  # the module's float32 evaluation, with these flags
    assert evaluate_cli.call(common + ["--weights_dtype", "int8"]) == 0
    wide = json.loads((float32_out / "metrics.json").read_text())
    with open(os.path.join(model_dir, "eval", "validation_step4_int8_len6", "metrics.json")) as f:
        narrow = json.load(f)  # the default output folder is named by the weights and length, beside float32's
    assert wide["weights_dtype"] == "float32" and narrow["weights_dtype"] == "int8"
    assert abs(narrow["log_perplexity"] - wide["log_perplexity"]) < 0.01
    text = tmp_path / "doc.txt"
    text.write_text("we study sparse layers in a model .\n")
    capsys.readouterr()
    argv = ["--checkpoint", model_dir, "--max_decode_length", "4", "--weights_dtype", "bfloat16", "--timing"]
    assert summarize.call([*argv, str(text)]) == 0
    out, err = capsys.readouterr()
    assert out.count("== ") == 1 and "(step " in out
    assert err.count("timing: batch 1/1: 1 document, ") == 1 and "ms/token (in the loop)" in err
    assert "random weights" not in out + err
    with pytest.raises(UsageError, match="--weights_dtype=int4: value should be one of <float32|bfloat16|int8>"):
        evaluate_cli.call(common + ["--weights_dtype", "int4"])
    # The same evaluation again would replace it: refused before decoding, unless --overwrite.
    with pytest.raises(ConfigError, match=r"validation_step4_int8_len6 holds an evaluation already \(20"):
        evaluate_cli.call(common + ["--weights_dtype", "int8"])


@pytest.mark.slow
def test_evaluate_list_prints_every_evaluation_of_the_run_without_tensorflow(
    finetuned, evaluated, no_tensorflow, capsys
):
    model_dir, _ = finetuned
    _, float32_out, _ = evaluated
    capsys.readouterr()
    assert evaluate_cli.call(["--list", model_dir]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| 20")]  # one per evaluation, dated
    float32 = json.loads((float32_out / "metrics.json").read_text())
    first = f"| validation | 4 | float32 | 0 | 0 | 5 | 6 | {100 * float32['rouge']['rouge1']['f1']:.2f} |"
    assert rows and first in rows[0] and rows[0].endswith(f"| {float32_out} |"), table
    with pytest.raises(UsageError, match="give it alone"):
        evaluate_cli.call(["--list", model_dir, "--checkpoint", model_dir])
    with pytest.raises(InputError, match="has no evaluation recorded yet"):
        evaluate_cli.call(["--list", str(float32_out)])


def test_a_strangers_table_of_evaluations_is_read_as_data_and_never_followed_or_waited_on(tmp_path, capsys):
    from terra import evaluation_table

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    table = run / "eval" / "results.jsonl"
    lines = [
        "not json",
        "[1, 2]",
        json.dumps({"date": "2026|12\n07", "split": {"a": 1}, "rouge_f1": [0.5], "log_perplexity": "low"}),
        json.dumps({"date": "2026-12-07", "step": 4, "rouge_f1": {"rouge1": 0.25, "rouge2": True}}),
    ]
    table.write_text("\n".join(lines) + "\n")
    assert evaluate_cli.call(["--list", str(run)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2026")]
    assert len(rows) == 2 and all(row.count(" | ") == 13 for row in rows), rows  # one cell each, no bar inside
    assert rows[0].startswith("| 2026/12 07 | {'a': 1} |") and "| 25.00 | — |" in rows[1]
    table.unlink()
    os.mkfifo(table)  # a FIFO: refused at once, not waited on
    with pytest.raises(InputError, match="is not a regular file"):
        evaluate_cli.call(["--list", str(run)])
    table.unlink()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("kept\n")
    table.symlink_to(elsewhere)  # a link planted in the run: nothing appended through it
    with pytest.raises(InputError, match="cannot add the evaluation"):
        evaluation_table.record(str(run), str(run / "eval" / "x"), {"rouge": {}, "date": "now"})
    assert elsewhere.read_text() == "kept\n"
    os.mkfifo(tmp_path / "metrics.json")  # an earlier evaluation's file that is not one: refused, not read
    with pytest.raises(ConfigError, match=r"holds an evaluation already \(an earlier run\)"):
        evaluator.check_not_evaluated(str(tmp_path), overwrite=False)


def test_each_setting_that_changes_an_evaluation_names_its_folder(tmp_path):
    name = functools.partial(evaluator.default_output_dir, "run", "test", 100, default_length=256)
    assert name() == os.path.join("run", "eval", "test_step100")
    assert name(max_decode_length=256) == name()
    assert name(weights_dtype="int8") == os.path.join("run", "eval", "test_step100_int8")
    assert name(temperature=0.5, seed=1, batch_size=4, num_examples=100, max_decode_length=64).endswith(
        "test_step100_t0.5_seed1_batch4_first100_len64"
    )
    assert name(seed=3, batch_size=4) == name()  # greedy decoding depends on neither
    (tmp_path / "metrics.json").write_text('{"date": "2026-12-07T06:00:00+00:00"}')
    with pytest.raises(
        ConfigError, match=r"holds an evaluation already \(2026-12-07T06:00:00\+00:00\): pass --overwrite"
    ):
        evaluator.check_not_evaluated(str(tmp_path), overwrite=False)
    evaluator.check_not_evaluated(str(tmp_path), overwrite=True)
    evaluator.check_not_evaluated(str(tmp_path / "new"), overwrite=False)


def test_summarize_reads_text_json_and_stdin_and_truncates_long_documents(finetuned, tmp_path, monkeypatch, capsys):
    model_dir, cohan = finetuned
    text = tmp_path / "doc.txt"
    text.write_text("we study sparse layers in a model .\nthe sparse layers make decoding fast .\n")
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("sparse layers make decoding fast . " * 200)
    papers = tmp_path / "papers.json"
    papers.write_text("\n".join(json.dumps(p) for p in _papers(2, 300)) + "\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"reversible networks save memory .")))
    argv = ["--checkpoint", model_dir, "--max_decode_length", "4", "--batch_size", "2"]
    assert summarize.call([*argv, str(text), str(long_doc), str(papers), "-"]) == 0
    printed, err = capsys.readouterr()
    assert printed.count("== ") == 5 and "papers.json [paper300]" in printed and "standard input" in printed
    assert "long.txt" in err and "truncated to the model's input length of 47" in err
    assert "generate: 100%" in err and "5/5" in err  # several batches: a progress bar on stderr


def test_summarize_stream_prints_the_summaries_the_batched_decode_prints(finetuned, tmp_path, capsys):
    model_dir, _ = finetuned
    docs = []
    for i, text in enumerate(["we study sparse layers in a model .", "reversible networks save memory ."]):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(text)
    argv = ["--checkpoint", model_dir, "--max_decode_length", "8", *map(str, docs)]
    assert summarize.call(argv) == 0
    batched = capsys.readouterr().out
    assert summarize.call([*argv, "--stream", "--timing"]) == 0
    streamed, err = capsys.readouterr()
    assert streamed == batched and streamed.count("== ") == 2
    assert err.count("timing: batch 1/1: 1 document, ") == 2  # one decode per document


def test_summarize_summarizes_what_it_can_and_names_every_file_it_could_not(finetuned, tmp_path, capsys):
    model_dir, _ = finetuned
    good, empty = tmp_path / "a.txt", tmp_path / "empty.txt"
    good.write_text("we study sparse layers in a model .")
    empty.write_text("  \n")
    argv = ["--checkpoint", model_dir, "--max_decode_length", "4", str(good), str(empty), str(tmp_path / "gone.txt")]
    with pytest.raises(InputError, match=r"2 input file\(s\) could not be summarized \(1 document\(s\) above were\)"):
        summarize.call(argv)
    printed = capsys.readouterr().out
    assert printed.count("== ") == 1 and f"== {good} (step " in printed  # a.txt is summarized
    with pytest.raises(InputError) as error:
        summarize.call(argv[:-1] + [str(empty)])
    assert f"{empty} is empty" in str(error.value) and "\n" not in str(error.value)


def test_summarize_rejects_bad_inputs_and_checkpoints_with_clear_messages(finetuned, tmp_path):
    model_dir, _ = finetuned
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("résumé".encode("latin-1"))
    with pytest.raises(InputError) as e:
        summarize.call(["--checkpoint", model_dir, str(empty), str(latin1), str(tmp_path / "missing.txt")])
    message = str(e.value)
    assert (
        "empty.txt is empty" in message
        and "latin1.txt is not UTF-8" in message
        and "missing.txt: cannot be read" in message
    )
    no_checkpoint = tmp_path / "run"
    no_checkpoint.mkdir()
    (no_checkpoint / "config.gin").write_text((open(os.path.join(model_dir, "config.gin")).read()))
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    with pytest.raises(Exception, match="no committed checkpoint under"):
        summarize.call(["--checkpoint", str(no_checkpoint), str(doc)])
    assert os.listdir(no_checkpoint) == ["config.gin"]  # nothing written, nothing lost


def _copy_task_run(root) -> str:
    """A run directory whose config.gin trains the copy task (no checkpoint: nothing is read)."""
    parsing.parse_gin(
        ["models/tiny.gin", "tasks/synthetic_copy.gin", "runs/train.gin"],
        ["TransformerConfig.vocab_size = 259", f"MODEL_DIR = {str(root)!r}", "BATCH_SIZE = 2", "TRAIN_STEPS = 1"],
    )
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.gin"), "w") as f:
        f.write(gin.config_str())
    return str(root)


def test_evaluate_and_summarize_refuse_a_run_that_is_not_a_summarization_run(tiny_model, tmp_path):
    run = _copy_task_run(tmp_path / "copy")
    doc = tmp_path / "doc.txt"
    doc.write_text("some text")
    with pytest.raises(ConfigError, match="synthetic task, not summarization"):
        summarize.call(["--checkpoint", run, str(doc)])
    with pytest.raises(ConfigError, match="not summarization.*--force"):
        evaluate_cli.call(["--checkpoint", run])
    model, _ = tiny_model
    with pytest.raises(ConfigError, match="synthetic task, not summarization"):
        evaluator.evaluate(
            model=model, task="synthetic_copy", feature_lengths={"inputs": 8, "targets": 8}, model_dir=run
        )
    assert os.listdir(run) == ["config.gin"]  # refused before reading or writing anything
    # Forced, the refusal gives way and the run's real problem (no checkpoint) is what stops it.
    with pytest.raises(Exception, match="no committed checkpoint under"):
        summarize.call(["--checkpoint", run, "--force", str(doc)])
