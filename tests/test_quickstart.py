"""`make run`'s job end to end at a smoke size: pretraining lowers the loss, fine-tuning starts
from it, summaries are decoded, and every artifact is written."""

import json
import os

from terra import quickstart

SMALL = ["--gin.TransformerConfig.d_model=32", "--gin.TransformerConfig.d_ff=64", "--gin.TransformerConfig.n_encoder_layers=1",
         "--gin.TransformerConfig.n_decoder_layers=1", "--gin.BATCH_SIZE=8", "--gin.terra.train.progress=False",
         "--gin.terra.train.eval_every=10", "--gin.terra.train.log_every=5", "--gin.terra.train.checkpoint_every=10"]


def test_quickstart_pretrains_fine_tunes_and_summarizes(tmp_path, capsys):
    out = tmp_path / "quick"
    argv = ["--out", str(out), "--pretrain_steps", "30", "--finetune_steps", "10", "--examples", "2", "--eval_examples", "6",
            "--max_decode_length", "8", *SMALL]
    assert quickstart.main(argv) == 0
    printed = capsys.readouterr().out
    with open(out / "pretrain" / "metrics.jsonl") as f:
        losses = [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]
    assert losses[-1] < losses[0]
    for run in ("pretrain", "finetune"):
        assert {"config.gin", "metrics.jsonl", "checkpoints", "tensorboard"} <= set(os.listdir(out / run))
    assert "parameters from" in printed and printed.count("summary  :") == 2 and "ms per token" in printed
    assert "ROUGE-LSum" in printed  # the Table 5 layout
    metrics = json.loads((out / "finetune" / "eval" / "validation_step10" / "metrics.json").read_text())
    assert metrics["n_examples"] == 6 and set(metrics["rouge"]) == {"rouge1", "rouge2", "rougeLsum", "rougeL"}
