"""`make run`'s job end to end at a smoke size: pretraining lowers the loss, fine-tuning starts
from it, summaries are decoded, and every artifact is written."""

import ast
import contextlib
import io
import json
import os
import re
import shutil

import pytest

from terra.benchmarks import presets
from terra.cli import quickstart

from helpers import REPO_ROOT

# Every test here shares an end-to-end run (a training, a study or a built wheel): the slow tier.
pytestmark = pytest.mark.slow

SMALL = [
    "--gin.TransformerConfig.d_model=32",
    "--gin.TransformerConfig.d_ff=64",
    "--gin.TransformerConfig.n_encoder_layers=1",
    "--gin.TransformerConfig.n_decoder_layers=1",
    "--gin.BATCH_SIZE=8",
    "--gin.terra.training.LoggingSettings.progress=False",
    "--gin.terra.training.EvaluationSettings.every=10",
    "--gin.terra.training.LoggingSettings.every=5",
    "--gin.terra.training.CheckpointSettings.every=10",
]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, fast_compile):
    """``(out folder, printed output)`` of one smoke-size quick start, shared by the module."""
    out = tmp_path_factory.mktemp("quick") / "runs" / "quickstart"
    argv = [
        "--out",
        str(out),
        "--pretrain_steps",
        "10",  # the loss logged every 5 steps already falls (from about 8.1 to 7.2)
        "--finetune_steps",
        "10",
        "--examples",
        "2",
        "--eval_examples",
        "6",
        "--max_decode_length",
        "8",
        *SMALL,
    ]
    printed = io.StringIO()
    # Step 4 times the 800M models (a minute, 2 GB); here the same code times tiny ones, and
    # measures the read bandwidth over the sparsity study's smoke buffer (16 MB, not 1 GB).
    tiny_rows = (
        ("dense baseline (models/tiny.gin)", "models/tiny.gin"),
        ("fully sparse (models/tiny_fully_sparse.gin)", "models/tiny_fully_sparse.gin"),
    )
    timing_config = presets.timing_config
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(quickstart, "DECODE_ROWS", tiny_rows)
        patch.setattr(presets, "timing_config", lambda rows, **kw: timing_config(rows, **kw, bandwidth_buffer_mb=16))
        assert quickstart.call(argv) == 0
    return out, printed.getvalue()


def test_quickstart_pretrains_fine_tunes_and_summarizes(quickstart_run):
    out, printed = quickstart_run
    with open(out / "pretrain" / "metrics.jsonl") as f:
        losses = [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]
    assert losses[-1] < losses[0]
    for run in ("pretrain", "finetune"):
        assert {"config.gin", "metrics.jsonl", "checkpoints", "tensorboard"} <= set(os.listdir(out / run))
    assert "parameters from" in printed and printed.count("summary  :") == 2 and "ms per token" in printed
    assert "== 4/4 what sparsity buys" in printed and "fully sparse (models/tiny_fully_sparse.gin)" in printed
    assert re.search(r"the fully sparse model decodes \d+\.\dx faster", printed)
    assert "ROUGE-LSum" in printed  # the Table 5 layout
    # The folder is named by the settings that change the results: 6 examples, 8 tokens.
    metrics = json.loads((out / "finetune" / "eval" / "validation_step10_first6_len8" / "metrics.json").read_text())
    assert metrics["n_examples"] == 6 and set(metrics["rouge"]) == {"rouge1", "rouge2", "rougeLsum", "rougeL"}


def _readme_python_api_block() -> str:
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = f.read()
    marker = readme.index("<!-- python-api:")
    start = readme.index("```python\n", marker) + len("```python\n")
    return readme[start : readme.index("```", start)]


def test_the_readme_python_api_example_runs_verbatim_on_the_quickstart_run(quickstart_run, monkeypatch, capsys):
    """The README's Python API block, executed as written, in the folder holding the quick-start
    run (``runs/quickstart``, as ``make run`` leaves it)."""
    out, _ = quickstart_run
    monkeypatch.chdir(out.parent.parent)
    exec(compile(_readme_python_api_block(), "README.md", "exec"), {})
    out_text = capsys.readouterr().out
    printed = out_text.splitlines()
    summary = ast.literal_eval(printed[0])[0]  # the greedy summary, which the stream prints again
    assert len(printed) == 9 + summary.count("\n") and printed[-1].endswith("parameters read per decoded token")
    assert f"{printed[2]}\n{summary}\n[-" in out_text, printed  # streamed word by word, then the score
    assert printed[-4].startswith("(1, ")


def test_the_fine_tuned_run_moved_elsewhere_loads_from_another_folder_with_its_own_vocabulary(
    quickstart_run, tmp_path, monkeypatch
):
    import terra

    out, _ = quickstart_run
    shutil.copytree(out / "finetune", tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    run = terra.load("../moved", step="10")
    copy = tmp_path / "moved" / "vocabulary" / "sentencepiece.model"
    assert run.vocabulary.sentencepiece_model_file == str(copy) and run.model_dir == str(tmp_path / "moved")
    # The copy is the model the run trained with (the embedded corpus's): the same bytes.
    from terra.data import vocabularies

    assert copy.read_bytes() == open(vocabularies.embedded_vocabulary_path(), "rb").read()
    assert run.step == 10 and run.generate(["sparse layers decode fast"], max_new_tokens=2)


def test_a_run_saved_from_python_keeps_its_vocabulary_and_summarizes_and_evaluates_as_a_run(
    quickstart_run, tmp_path, capsys
):
    import terra
    from terra.cli import evaluate, summarize

    out, _ = quickstart_run
    run = terra.load(str(out / "finetune"))
    saved = run.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "vocabulary" / "sentencepiece.model").read_bytes() == open(
        run.vocabulary.sentencepiece_model_file, "rb"
    ).read()
    doc = tmp_path / "doc.txt"
    doc.write_text("Return the number of items in a container.")
    argv = ["--max_decode_length", "8", str(doc)]
    assert summarize.call(["--checkpoint", str(out / "finetune"), *argv]) == 0
    original = capsys.readouterr().out
    assert summarize.call(["--checkpoint", saved, *argv]) == 0
    assert capsys.readouterr().out == original  # the same step, text and summary
    narrow = run.quantized("int8").save(tmp_path / "int8")
    assert evaluate.call(["--checkpoint", narrow, "--num_examples", "2", "--max_decode_length", "4"]) == 0
    metrics = json.loads(
        (tmp_path / "int8" / "eval" / "validation_step10_int8_first2_len4" / "metrics.json").read_text()
    )
    assert metrics["weights_dtype"] == "int8" and metrics["n_examples"] == 2
