"""Commands and API calls that read no data never import TensorFlow, seqio or TensorFlow
Datasets (their import is most of a command's start-up): ``terra-params`` (of a model config or
of an experiment, whose task config it reads past), ``terra-configs``,
``terra-evaluate --list``, ``terra-convert trax``
without a task, ``terra-bench decode``, ``terra.build`` of a model config, ``terra.load`` of a
run without a task or of a summarization run, and ``terra-summarize`` of a document. One process
runs them in turn, as commands do (``main``), and after each one reports which of those packages
are loaded: the first command that loads one fails the test, named. Asking a summarization run
for its seqio task, or building a config with a task, still loads them (the last checks)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

DENSE = os.path.join(REPO_ROOT, "tests", "fixtures", "trax", "dense")
DATA_PACKAGES = ("tensorflow", "seqio", "tensorflow_datasets")

SCRIPT = """
import json, sys
DATA_PACKAGES = {packages!r}
loaded = lambda: sorted(m for m in sys.modules if m.split(".")[0] in DATA_PACKAGES)
report = []

def step(name, fn):
    status = fn()
    report.append({{"step": name, "status": status, "loaded": loaded()}})

from terra.cli import bench, configs, convert, evaluate, params, summarize
step("terra-params", lambda: params.main(["--gin_file=models/tiny.gin"]))
step("terra-params of an experiment", lambda: params.main(["--gin_file=experiments/quickstart.gin"]))
step("terra-configs", lambda: configs.main([]))
step("terra-evaluate --list", lambda: evaluate.main(["--list", "{evaluated}"]))
step(
    "terra-convert trax",
    lambda: convert.main(
        ["trax", "--checkpoint={dense}/model.pkl.gz", "--trax_config={dense}/config.json", "--out={out}"]
    ),
)
step(
    "terra-bench decode",
    lambda: bench.main(
        ["decode", "--preset", "tiny", "--config.tokens=4", "--config.repeats=1", "--rows=baseline", "--out={bench}"]
    ),
)
import numpy as np
import terra
tokens = np.ones((1, 4), np.int32)
generates = lambda run: int(run.generate(tokens, max_new_tokens=2).shape != (1, 2))
step("terra.build", lambda: generates(terra.build("models/tiny.gin")))
step("terra.load without a task", lambda: generates(terra.load("{out}")))
summary = terra.load("{summarization_run}")
step("terra.load of a summarization run", lambda: int(not summary.generate("Some words.", max_new_tokens=2)))
summarize_argv = ["--checkpoint={summarization_run}", "--max_decode_length=2", "{document}"]
step("terra-summarize", lambda: summarize.main(summarize_argv))
step("the run's task, asked for", lambda: int(summary.task.name != "embedded_summarization"))
with_task = ["models/tiny.gin", "tasks/synthetic_copy.gin"]
step("terra.build with a task config", lambda: int(terra.build(with_task).task is None))
print("REPORT " + json.dumps(report))
"""


def _summarization_run(run) -> str:
    """A run directory as training writes one (config.gin, vocabulary copy, a checkpoint) of the
    tiny model on the embedded summarization task, with a small SentencePiece model of its own."""
    import shutil

    import gin
    import jax

    from terra.data import vocabularies
    from terra.gin_config import parsing
    from terra.training import checkpointing, run_directory

    texts = [f"A summary line {i} of a document about operating systems, files and paths." for i in range(50)]
    model_file = vocabularies.train_sentencepiece(texts, str(run.parent / "tiny.model"), vocab_size=300)
    bindings = [
        "TransformerConfig.vocab_size = 512",
        f"terra.data.text_vocabulary.spm_path = {model_file!r}",
        "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}",
    ]
    parsing.parse_gin(["models/tiny.gin", "tasks/embedded_summarization.gin"], bindings, finalize=False)
    model = parsing.build_model()
    run_directory.write_config(str(run), gin.config_str())
    (run / "vocabulary").mkdir()
    shutil.copy(model_file, run / "vocabulary" / "sentencepiece.model")
    writer = checkpointing.Checkpointer(str(run), save_interval_steps=1, keep_last=None)
    try:
        writer.save(0, {"params": model.init_params(jax.random.key(0))}, force=True)
    finally:
        writer.close()
    return str(run)


def _evaluated_run(run) -> str:
    """A run folder holding only its table of evaluations, one line of it."""
    (run / "eval").mkdir(parents=True)
    line = {"date": "2026-12-07T06:00:00+00:00", "split": "validation", "step": 4, "rouge_f1": {"rouge1": 0.25}}
    (run / "eval" / "results.jsonl").write_text(json.dumps(line) + "\n")
    return str(run)


@pytest.mark.slow
def test_commands_that_read_no_data_never_import_tensorflow(tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("The os module provides a portable way of using operating system dependent functionality.\n")
    script = SCRIPT.format(
        packages=DATA_PACKAGES,
        dense=DENSE,
        out=tmp_path / "converted",
        bench=tmp_path / "bench",
        summarization_run=_summarization_run(tmp_path / "summarization"),
        document=document,
        evaluated=_evaluated_run(tmp_path / "evaluated"),
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", TERRA_HUGE_PAGES_RESTARTED="1")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    for entry in report[:-2]:
        assert entry["status"] == 0, entry
        assert entry["loaded"] == [], f"{entry['step']} imported {entry['loaded']}"
    assert [entry["step"] for entry in report[-2:]] == ["the run's task, asked for", "terra.build with a task config"]
    for entry in report[-2:]:
        assert entry["status"] == 0 and "seqio" in entry["loaded"] and "tensorflow" in entry["loaded"], entry
