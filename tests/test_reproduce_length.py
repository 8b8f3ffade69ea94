"""`python -m terra.reproduce length_generalization`: end to end at smoke size, and its length arithmetic."""

import json
import os

import pytest

from conftest import ONE_DEVICE, is_png
from terra.reproduce import __main__ as cli
from terra.reproduce import length_generalization

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_length_generalization_writes_table_4_analogue_for_both_models_and_tasks(tmp_path):
    out = str(tmp_path / "length")
    assert cli.main(["length_generalization", "--out", out, "--preset", "smoke", ONE_DEVICE]) == 0
    payload = json.load(open(os.path.join(out, "length_generalization.json")))
    assert {(r["task"], r["model"]) for r in payload["runs"]} == {
        (t, m) for t in ("copy", "addition") for m in ("transformer", "terraformer")}
    for record in payload["runs"]:
        for where in ("in_distribution", "out_of_distribution"):
            for metric in ("token_accuracy", "sequence_accuracy"):
                assert 0.0 <= record[where][metric] <= 1.0
        # Out-of-distribution figures are the trainer's last evaluation on the longer split.
        assert record["out_of_distribution"]["token_accuracy"] == record["curves"]["eval/token_accuracy"][-1][1]
    rows = {r["model"]: r for r in payload["rows"]}
    assert set(rows) == {"transformer", "terraformer"}
    table = open(os.path.join(out, "length_generalization.md")).read()
    assert "| model | copy | copy (seq) | addition | addition (seq) |" in table
    assert "| Terraformer (paper) | 99.9 | 93.9 | 86.9 | 32.4 | — |" in table
    assert is_png(os.path.join(out, "length_generalization.png"))


def test_addition_feature_lengths_fit_the_reference_length_formulas():
    # trax_reference.md §7: eval inputs up to 301 symbols, first operand up to 214 digits.
    assert length_generalization._addition_feature_lengths(257, 301) == {"inputs": 302, "targets": 216}
    assert length_generalization._addition_feature_lengths(3, 129) == {"inputs": 130, "targets": 66}


@pytest.mark.parametrize("preset", ["small", "paper"])
def test_length_generalization_evaluates_on_inputs_at_least_twice_the_training_length(preset):
    cfg = length_generalization.config(preset)
    assert cfg.copy_eval_min_length >= 2 * (cfg.copy_train_length - 1)
    train_digits = length_generalization._addition_feature_lengths(3, cfg.addition_train_max_length)["targets"] - 2
    assert (cfg.addition_eval_min_length - 1) // 2 >= 2 * train_digits
