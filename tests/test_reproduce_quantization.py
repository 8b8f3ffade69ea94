"""`terra-reproduce quantization` on a tiny trained run: every width's eval log-perplexity, its Δ to
float32 and greedy agreement; the agreement's definition; the errors before anything is measured."""

import json
import os

import numpy as np
import pytest

from terra.cli import reproduce as cli
from terra.errors import ConfigError
from terra.reproduce import quantization, runs

from helpers import ONE_DEVICE

# Every test here shares an end-to-end run (a training, a study or a built wheel): the slow tier.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.slow]

EVAL_STEPS = 2


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A study folder holding one tiny span-corruption run, trained 3 steps and evaluated on
    ``EVAL_STEPS`` batches at the end, as ``terra-reproduce sparsity`` lays its runs out."""
    root = tmp_path_factory.mktemp("study")
    runs.train_run(
        "dense",
        1,  # not the pipeline's default seed: the study must read the run's own
        str(root / "runs" / "dense" / "seed1"),
        ["models/tiny.gin", "tasks/embedded_span_corruption.gin", "runs/train.gin"],
        [
            "TransformerConfig.vocab_size = 4100",
            "TransformerConfig.d_model = 32",
            "TransformerConfig.d_ff = 64",
            "TransformerConfig.n_encoder_layers = 1",
            "TransformerConfig.n_decoder_layers = 1",
            "TASK_FEATURE_LENGTHS = {'inputs': 32, 'targets': 8}",
            "BATCH_SIZE = 4",
            "TRAIN_STEPS = 3",
            "terra.training.EvaluationSettings.every = 3",
            f"terra.training.EvaluationSettings.steps = {EVAL_STEPS}",
            "terra.training.LoggingSettings.every = 3",
            "terra.training.CheckpointSettings.every = 3",
            ONE_DEVICE.removeprefix("--gin."),
        ],
        log=lambda *_: None,
    )
    return str(root)


def test_the_study_measures_every_width_against_float32_and_writes_json_and_markdown(study, tmp_path):
    out = str(tmp_path / "quality")
    args = ["quantization", "--study", study, "--out", out, "--preset", "smoke", f"--config.eval_batches={EVAL_STEPS}"]
    assert cli.call(args) == 0

    rows = json.load(open(os.path.join(out, "quantization.json")))["rows"]
    assert [(r["run"], r["weights"]) for r in rows] == [(os.path.join("dense", "seed1"), w) for w in quantization.BARS]
    wide, bf16, int8 = rows
    # The trainer's own evaluation, reproduced: same batches (converter, lengths, data seed of the
    # span-corruption noise), same sums.
    assert wide["eval_log_perplexity"] == pytest.approx(wide["run_final_eval_loss"], rel=1e-5)
    assert wide["delta_vs_float32"] == 0 and wide["token_agreement"] == wide["sequence_agreement"] == 1.0
    assert wide["agreement_tokens"] > 0 and wide["agreement_sequences"] == 4
    for row in (bf16, int8):
        assert row["delta_vs_float32"] == pytest.approx(row["eval_log_perplexity"] - wide["eval_log_perplexity"])
        assert abs(row["delta_vs_float32"]) < 0.05
        assert 0.0 <= row["token_agreement"] <= 1.0 and 0.0 <= row["sequence_agreement"] <= 1.0
    # The narrow weights were read: int8 moves the loss, and the stored bytes shrink.
    assert int8["delta_vs_float32"] != 0
    assert int8["weight_bytes"] < 0.3 * wide["weight_bytes"] and bf16["weight_bytes"] < 0.55 * wide["weight_bytes"]
    table = open(os.path.join(out, "quantization.md")).read()
    assert "| run | weights | eval log-ppl | Δ vs float32 |" in table
    assert f"| {os.path.join('dense', 'seed1')} | int8 | {int8['eval_log_perplexity']:.4f} |" in table
    assert f"4 decoded ({wide['float32_distinct_outputs']} distinct float32 outputs)" in table


def test_agreement_compares_each_row_up_to_the_first_eos_of_either_output():
    eos = 1
    reference = np.array([[5, 6, 1, 0], [5, 6, 7, 1], [5, 6, 7, 8], [5, 6, 1, 0]])
    other = np.array(
        [
            [5, 6, 1, 0],  # identical: 3 positions through EOS
            [5, 1, 0, 0],  # stops early: 2 compared, 1 identical (its EOS against 6)
            [5, 9, 7, 8],  # no EOS in either: all 4 compared, 3 identical
            [5, 6, 7, 1],  # runs on past the reference's EOS: 3 compared, 2 identical
        ]
    )
    assert quantization.agreement(reference, other, eos) == {
        "tokens": 3 + 2 + 4 + 3,
        "identical_tokens": 3 + 1 + 3 + 2,
        "sequences": 4,
        "identical_sequences": 1,
    }
    assert quantization.agreement(reference, reference, eos)["identical_sequences"] == 4
    # What follows EOS is not read: the first two rows are one output.
    assert quantization.distinct_outputs(np.array([[5, 1, 0], [5, 1, 7], [5, 6, 7]]), eos) == 2


def test_runs_and_settings_are_checked_before_anything_is_measured(study, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"{empty} holds no trained runs"):
        cli.call(["quantization", "--study", str(empty), "--out", str(out)])
    with pytest.raises(ConfigError, match=f"{empty}/config.gin does not exist"):
        cli.call(["quantization", "--runs", f"{study}/runs/dense/seed1,{empty}", "--out", str(out)])
    with pytest.raises(ConfigError, match="either run directories"):
        cli.call(["quantization", "--out", str(out)])
    with pytest.raises(ConfigError, match="needs float32"):
        cli.call(["quantization", "--study", study, "--out", str(out), "--config.weights=int8,bfloat16"])
    with pytest.raises(ConfigError, match="decode_examples=0 must be positive"):
        cli.call(["quantization", "--study", study, "--out", str(out), "--config.decode_examples=0"])
    assert not out.exists()
    # Given runs are labelled by their folder, or by their path where two share a name.
    seed1 = f"{study}/runs/dense/seed1"
    other = tmp_path / "other" / "seed1"
    other.mkdir(parents=True)
    (other / "config.gin").write_text(open(f"{seed1}/config.gin").read())
    assert quantization.find_runs([seed1]) == {"seed1": seed1}
    assert quantization.find_runs([seed1, f"{other}/"]) == {seed1: seed1, str(other): f"{other}/"}
