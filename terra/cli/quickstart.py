"""The quick start behind `make run`: pretrain, fine-tune and evaluate on the embedded corpus.

1. Pretrains the tiny encoder-decoder of experiments/quickstart.gin with span corruption on the
   embedded corpus (Python's own documentation; nothing to download).
2. Fine-tunes it on the embedded summarization task (experiments/quickstart_finetune.gin:
   docstring body -> summary line), starting from the pretrained parameters.
3. Evaluates the fine-tuned model on the validation split as terra-evaluate does: greedy
   summaries through the jitted decode step, ROUGE-1/2/LSum/LSent F1 with rouge-score and
   log-perplexity (<out>/finetune/eval/); prints a few summaries.
4. Shows what terra is for: times batch-1 decoding of the dense baseline and of the fully
   sparse model at the paper's 800M widths (2+24-layer timing shape, random weights) with the
   decode-speed benchmark's code, and prints the speed-up (--nodecode_speed skips it).

Both runs are ordinary terra-train runs (checkpoints, metrics.jsonl, TensorBoard events,
config.gin under --out); running the quick start again resumes them. Extra --gin.NAME=VALUE
flags apply to both runs.

  terra-quickstart                       # what `make run` runs
  terra-quickstart --out /tmp/quick --pretrain_steps 100 --finetune_steps 50
"""

import os
import textwrap
from typing import List

from absl import flags

from terra.cli import app

# Step 4 times two models: the dense baseline and the model with every decoder layer sparse
# (feed-forward, QKV, encoder-decoder attention and loss; paper §3).
DECODE_ROWS = (
    ("dense baseline (models/dense_800m.gin)", "models/dense_800m.gin"),
    ("fully sparse (models/fully_sparse_800m.gin)", "models/fully_sparse_800m.gin"),
)


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flags.DEFINE_string("out", "runs/quickstart", "folder of the two runs", flag_values=flag_values)
    flags.DEFINE_integer("pretrain_steps", 300, "pretraining steps", flag_values=flag_values)
    flags.DEFINE_integer("finetune_steps", 200, "fine-tuning steps", flag_values=flag_values)
    flags.DEFINE_integer("examples", 3, "validation summaries to print", flag_values=flag_values)
    flags.DEFINE_integer(
        "eval_examples",
        None,
        "validation examples to score with ROUGE (default: the whole split)",
        flag_values=flag_values,
    )
    flags.DEFINE_integer("max_decode_length", 32, "most tokens per summary", flag_values=flag_values)
    flags.DEFINE_bool(
        "decode_speed",
        True,
        "time dense against fully sparse decoding at the 800M widths (step 4; about a minute, 2 GB of memory)",
        flag_values=flag_values,
    )
    flags.DEFINE_multi_string(
        "gin_bindings",
        [],
        "a gin binding applied to both runs (--gin.NAME=VALUE is the short form)",
        flag_values=flag_values,
    )


def _losses(model_dir: str, key: str) -> List[float]:
    from terra.training import metrics as metrics_lib

    return [row[key] for row in metrics_lib.read_metrics(model_dir) if key in row]


def _train(gin_file: str, model_dir: str, steps: int, bindings: List[str]):
    from terra.gin_config import parsing
    from terra.training import trainer

    parsing.parse_gin([gin_file], [f"MODEL_DIR = {model_dir!r}", f"TRAIN_STEPS = {steps}", *bindings])
    return trainer.Trainer().run()


def _decode_speed() -> None:
    """What sparsity buys: the decode-speed benchmark's own code on the dense baseline and the
    fully sparse model at the paper's 800M widths and timing shape, random weights, batch 1."""
    from terra.benchmarks import decode_speed, presets

    print(
        "\n== 4/4 what sparsity buys: batch-1 decoding at the paper's 800M widths, 2+24-layer timing shape "
        "(random weights; about a minute)"
    )
    config = presets.timing_config(
        [presets.make_row(name, gin_file) for name, gin_file in DECODE_ROWS], repeats=2, warmup=2
    )
    dense, sparse = decode_speed.run_preset(config, None, "quick start", log=lambda line: None)
    bandwidth = dense["bandwidth_gbps"]
    for row in (dense, sparse):
        if row["seconds_per_token_loop"] is not None:
            time = f"{row['seconds_per_token_loop'] * 1e3:.1f} ms per token in the generation loop"
        else:  # the loop's jitter hid the in-loop time: the step-call time stands in for it
            time = f"{row['seconds_per_token_median'] * 1e3:.1f} ms per token as one step call"
        print(
            f"   {row['name']:<44} {time}; reads {row['bytes_per_token'] / 1e6:,.0f} MB per token "
            f"(floor {row['floor_seconds'] * 1e3:.1f} ms at {bandwidth:.0f} GB/s)"
        )
    speedup = sparse["speedup_vs_dense_loop"] or sparse["speedup_vs_dense"]
    print(
        f"   -> the fully sparse model decodes {speedup:.1f}x faster than the dense one on this CPU "
        f"({dense['bytes_per_token'] / sparse['bytes_per_token']:.0f}x fewer bytes per token). "
        "`make bench` times every row of the paper's Tables 1, 2 and 7."
    )


def run(flag_values: flags.FlagValues, _) -> int:
    from terra.evaluation import evaluator
    from terra.gin_config import parsing

    out, extra = flag_values.out, list(flag_values.gin_bindings)
    pretrain_dir, finetune_dir = os.path.join(out, "pretrain"), os.path.join(out, "finetune")

    print(f"== 1/4 pretraining on the embedded corpus (span corruption) -> {pretrain_dir}")
    _train("experiments/quickstart.gin", pretrain_dir, flag_values.pretrain_steps, extra)
    losses = _losses(pretrain_dir, "train/loss")
    print(f"   train loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    print(f"== 2/4 fine-tuning on embedded summarization -> {finetune_dir}")
    _train(
        "experiments/quickstart_finetune.gin",
        finetune_dir,
        flag_values.finetune_steps,
        [f"INIT_FROM = {pretrain_dir!r}", *extra],
    )
    evals = _losses(finetune_dir, "eval/loss")
    if evals:
        print(f"   eval log-perplexity {evals[0]:.3f} -> {evals[-1]:.3f} (nats per target token)")

    print("== 3/4 evaluating on the validation split: greedy summaries, ROUGE (rouge-score), log-perplexity")
    model = parsing.build_model()
    lengths = parsing.gin.query_parameter("%TASK_FEATURE_LENGTHS")
    evaluation = evaluator.evaluate(
        model=model,
        task="embedded_summarization",
        feature_lengths=lengths,
        model_dir=finetune_dir,
        batch_size=16,
        max_decode_length=flag_values.max_decode_length,
        num_examples=flag_values.eval_examples,
        overwrite=True,  # `make run` again: the same finished run evaluated again, to the same results
        log=lambda s: print(textwrap.indent(s, "   ")),
    )
    for row in evaluation.predictions[: flag_values.examples]:
        print(f"\n  document : {row['input'][:160].replace(chr(10), ' ')}{'...' if len(row['input']) > 160 else ''}")
        print(f"  reference: {row['target']}")
        print(f"  summary  : {row['prediction']}")
    print(
        f"\n   The summaries come from a {model.param_count()['total'] / 1e6:.1f}M-parameter model after "
        f"{flag_values.pretrain_steps} + {flag_values.finetune_steps} steps on a CPU: its ROUGE checks the pipeline "
        "(tokenize, train, decode, score), not summarization quality; the paper's 800M Terraformer, pretrained "
        "on C4 and fine-tuned on arXiv, reaches ROUGE-1 45.4 (Table 5)."
    )
    if flag_values.decode_speed:
        _decode_speed()
    print(f"\nruns, metrics.jsonl, TensorBoard events and config.gin are under {out}")
    return 0


COMMAND = app.command(
    "terra-quickstart", "terra.cli.quickstart", __doc__, define_flags=define_flags, run=run, reads_data=True
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
