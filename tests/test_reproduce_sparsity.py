"""`terra-reproduce sparsity` end to end at smoke size; both studies' error paths and seed statistics."""

import json
import os

import pytest

from terra.cli import reproduce as cli
from terra.errors import ConfigError, DataNotFoundError, UsageError
from terra.reproduce import runs, sparsity

from helpers import ONE_DEVICE, is_png

# Every test here shares an end-to-end run (a training, a study or a built wheel): the slow tier.
pytestmark = [pytest.mark.usefixtures("fast_compile"), pytest.mark.slow]


def test_sparsity_study_trains_every_variant_and_seed_and_writes_json_markdown_png(tmp_path):
    out = str(tmp_path / "sparsity")
    args = [
        "sparsity",
        "--out",
        out,
        "--preset",
        "smoke",
        "--config.variants=dense,sparse_ff_16",
        "--config.seeds=0,1",
        "--config.steps=2",
        "--config.eval_every=2",
        ONE_DEVICE,
    ]
    assert cli.call(args) == 0

    payload = json.load(open(os.path.join(out, "sparsity.json")))
    assert [r["variant"] for r in payload["rows"]] == ["dense", "sparse_ff_16"]
    assert {(r["variant"], r["seed"]) for r in payload["runs"]} == {
        (v, s) for v in ("dense", "sparse_ff_16") for s in (0, 1)
    }
    final = {(r["variant"], r["seed"]): r["curves"]["eval/loss"][-1] for r in payload["runs"]}
    assert all(step == 2 for step, _ in final.values())
    dense, sparse = payload["rows"]
    # The gap is paired per seed and computed from the runs' own final eval losses.
    gaps = [final[("sparse_ff_16", s)][1] - final[("dense", s)][1] for s in (0, 1)]
    assert sparse["gap_to_dense"]["n"] == 2
    assert sparse["gap_to_dense"]["mean"] == pytest.approx(sum(gaps) / 2)
    assert sparse["gap_to_dense"]["min"] == pytest.approx(min(gaps)) and sparse["gap_to_dense"]["max"] == pytest.approx(
        max(gaps)
    )
    assert dense["gap_to_dense"]["mean"] == 0.0 and dense["decode_speedup_vs_dense"] == 1.0
    assert sparse["params"] != dense["params"] and sparse["decode_seconds_per_token"] > 0
    # Different seeds are different runs.
    assert final[("dense", 0)] != final[("dense", 1)]
    table = open(os.path.join(out, "sparsity.md")).read()
    assert "| dense baseline |" in table and "| Sparse FF N=16 |" in table and "±" in table
    assert is_png(os.path.join(out, "sparsity.png"))
    # Each run is an ordinary training run with its checkpoint and config.
    assert os.path.exists(os.path.join(out, "runs", "sparse_ff_16", "seed1", "config.gin"))


def test_sparsity_study_rejects_bad_settings_before_training(tmp_path):
    cfg = sparsity.config("smoke")
    cfg.variants = "sparse_ff_16"
    with pytest.raises(ConfigError, match="needs the 'dense' variant"):
        sparsity.run(cfg, str(tmp_path))
    cfg.variants = "dense,sparse_ff_17"
    with pytest.raises(ConfigError, match="unknown variants"):
        sparsity.run(cfg, str(tmp_path))
    cfg.variants, cfg.size = "dense,sparse_ff_64", "small"
    cfg.seeds = "0,0"
    with pytest.raises(ConfigError, match="distinct"):
        sparsity.run(cfg, str(tmp_path))
    with pytest.raises(UsageError, match="unknown --config field 'step'. Did you mean \"steps\""):
        cli.call(["sparsity", "--out", str(tmp_path), "--config.step=3"])
    with pytest.raises(UsageError, match="--config.steps=many: invalid literal for int"):
        cli.call(["sparsity", "--out", str(tmp_path), "--preset", "smoke", "--config.steps=many"])
    with pytest.raises(DataNotFoundError, match="C4 JSON under /nowhere: no file for split .train."):
        cli.call(["sparsity", "--out", str(tmp_path), "--preset", "smoke", "--c4_json=/nowhere"])
    with pytest.raises(UsageError, match="generates its data"):
        cli.call(["length_generalization", "--out", str(tmp_path), "--c4_json=/nowhere"])
    assert not os.listdir(tmp_path)


def test_mean_and_spread_over_seeds():
    stats = runs.mean_and_spread([1.0, 2.0, 3.0])
    assert stats == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 3}
    assert runs.format_mean(stats) == "2.000 ± 1.000"
    assert runs.format_mean(runs.mean_and_spread([0.5]), 1, 100) == "50.0"
    assert runs.parse_seeds(3) == [0, 1, 2] and runs.parse_seeds("4,7") == [4, 7]
