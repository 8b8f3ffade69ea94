"""`terra-reproduce length_generalization`: end to end at smoke size, and its length arithmetic."""

import json
import os

import pytest

from terra.cli import reproduce as cli
from terra.data import pipeline, synthetic, tasks
from terra.gin_config import parsing
from terra.reproduce import length_generalization

from helpers import ONE_DEVICE, is_png

# Every test here shares an end-to-end run (a training, a study or a built wheel): the slow tier.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.slow]


def test_length_generalization_writes_table_4_analogue_for_both_models(tmp_path):
    # Copy only: the addition runs differ in their data bindings alone, which the next test
    # checks example by example without training.
    out = str(tmp_path / "length")
    assert (
        cli.call(["length_generalization", "--out", out, "--preset", "smoke", "--config.tasks=copy", ONE_DEVICE]) == 0
    )
    payload = json.load(open(os.path.join(out, "length_generalization.json")))
    assert {(r["task"], r["model"]) for r in payload["runs"]} == {("copy", "transformer"), ("copy", "terraformer")}
    for record in payload["runs"]:
        for where in ("in_distribution", "out_of_distribution"):
            for metric in ("token_accuracy", "sequence_accuracy"):
                assert 0.0 <= record[where][metric] <= 1.0
        # Out-of-distribution figures are the trainer's last evaluation on the longer split.
        assert record["out_of_distribution"]["token_accuracy"] == record["curves"]["eval/token_accuracy"][-1][1]
    rows = {r["model"]: r for r in payload["rows"]}
    assert set(rows) == {"transformer", "terraformer"}
    table = open(os.path.join(out, "length_generalization.md")).read()
    assert "| model | copy | copy (seq) | in distribution (token / seq) |" in table
    assert "| Terraformer (paper) | 99.9 | 93.9 | — |" in table
    assert is_png(os.path.join(out, "length_generalization.png"))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_addition_bindings_give_untruncated_sums_at_both_lengths(split):
    cfg = length_generalization.config("small")
    bindings = length_generalization._task_bindings(cfg, "addition")
    parsing.parse_gin(["experiments/synthetic_addition_transformer.gin"], [*bindings, "MODEL_DIR = '/unused'"])
    lengths = parsing.gin.query_parameter("%TASK_FEATURE_LENGTHS" if split == "train" else "%EVAL_FEATURE_LENGTHS")
    task = tasks.get_task("synthetic_addition")
    vocabulary = task.output_features["targets"].vocabulary
    batch = next(
        pipeline.BatchIterator(
            pipeline.get_dataset(task, split=split, feature_lengths=lengths, batch_size=64, shuffle=False, num_epochs=1)
        )
    )
    first_operands, second_operands = [], []
    for inputs, targets in zip(batch["encoder_input_tokens"], batch["decoder_target_tokens"]):
        x, y = vocabulary.decode([int(t) for t in inputs if t > 1]).split("+")
        total = vocabulary.decode([int(t) for t in targets if t > 1])
        # Little-endian digits: a truncated input or sum would break the equality.
        assert int(x[::-1]) + int(y[::-1]) == int(total[::-1])
        first_operands.append(len(x))
        second_operands.append(len(y))
    # The small preset: first operands of at most 16 digits in training, at least 32 in
    # evaluation; in training the second operand can be the longer one (its sum is what the
    # target length must hold).
    if split == "train":
        assert max(first_operands) <= 16 < max(second_operands)
    else:
        assert min(first_operands) >= 32


def test_addition_feature_lengths_fit_the_reference_length_formulas():
    # docs/design/reference_code.md §7: eval inputs up to 301 symbols, first operand up to 214 digits.
    assert synthetic.addition_feature_lengths(257, 301) == {"inputs": 302, "targets": 216}
    # Training: the second operand can reach 127 digits (129 - 1 - 1), so the sum 128.
    assert synthetic.addition_feature_lengths(3, 129) == {"inputs": 130, "targets": 129}


@pytest.mark.parametrize("preset", ["small", "paper"])
def test_length_generalization_evaluates_on_inputs_at_least_twice_the_training_length(preset):
    cfg = length_generalization.config(preset)
    assert cfg.copy_eval_min_length >= 2 * (cfg.copy_train_length - 1)
    (_, train_most), _ = synthetic.addition_operand_digits(cfg.addition_train_min_length, cfg.addition_train_max_length)
    (eval_fewest, _), _ = synthetic.addition_operand_digits(cfg.addition_eval_min_length, cfg.addition_eval_max_length)
    assert eval_fewest >= 2 * train_most
