"""The quick start behind `make run`: pretrain, fine-tune and evaluate on the embedded corpus.

1. Pretrains the tiny encoder-decoder of experiments/quickstart.gin with span corruption on the
   embedded corpus (Python's own documentation; nothing to download).
2. Fine-tunes it on the embedded summarization task (experiments/quickstart_finetune.gin:
   docstring body -> summary line), starting from the pretrained parameters.
3. Evaluates the fine-tuned model on the validation split as terra-evaluate does: greedy
   summaries through the jitted decode step, ROUGE-1/2/LSum/LSent F1 with rouge-score and
   log-perplexity (<out>/finetune/eval/); prints a few summaries and the batch-1 latency.

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
    from terra import gin_utils
    from terra.training import trainer

    gin_utils.parse_gin([gin_file], [f"MODEL_DIR = {model_dir!r}", f"TRAIN_STEPS = {steps}", *bindings])
    return trainer.Trainer().run()


def run(flag_values: flags.FlagValues, _) -> int:
    import jax

    from terra import gin_utils
    from terra.benchmarks.decode_speed import measure_decode
    from terra.evaluation import evaluator, summaries

    out, extra = flag_values.out, list(flag_values.gin_bindings)
    pretrain_dir, finetune_dir = os.path.join(out, "pretrain"), os.path.join(out, "finetune")

    print(f"== 1/3 pretraining on the embedded corpus (span corruption) -> {pretrain_dir}")
    _train("experiments/quickstart.gin", pretrain_dir, flag_values.pretrain_steps, extra)
    losses = _losses(pretrain_dir, "train/loss")
    print(f"   train loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    print(f"== 2/3 fine-tuning on embedded summarization -> {finetune_dir}")
    result = _train(
        "experiments/quickstart_finetune.gin",
        finetune_dir,
        flag_values.finetune_steps,
        [f"INIT_FROM = {pretrain_dir!r}", *extra],
    )
    evals = _losses(finetune_dir, "eval/loss")
    if evals:
        print(f"   eval log-perplexity {evals[0]:.3f} -> {evals[-1]:.3f} (nats per target token)")

    print("== 3/3 evaluating on the validation split: greedy summaries, ROUGE (rouge-score), log-perplexity")
    model = gin_utils.build_model()
    lengths = gin_utils.gin.query_parameter("%TASK_FEATURE_LENGTHS")
    evaluation = evaluator.evaluate(
        model=model,
        task="embedded_summarization",
        feature_lengths=lengths,
        model_dir=finetune_dir,
        batch_size=16,
        max_decode_length=flag_values.max_decode_length,
        num_examples=flag_values.eval_examples,
        log=lambda s: print(textwrap.indent(s, "   ")),
    )
    for row in evaluation.predictions[: flag_values.examples]:
        print(f"\n  document : {row['input'][:160].replace(chr(10), ' ')}{'...' if len(row['input']) > 160 else ''}")
        print(f"  reference: {row['target']}")
        print(f"  summary  : {row['prediction']}")
    first_input = summaries.pad_batch([evaluation.examples[0].inputs], 1, lengths["inputs"])
    timing = measure_decode(
        model.decoder(flag_values.max_decode_length),
        jax.device_get(result.params),
        first_input,
        n_tokens=min(12, flag_values.max_decode_length),
    )
    summary = timing.summary()
    print(
        f"\nbatch-1 decode: {summary['token_median_s'] * 1e3:.3f} ms per token as one step call each (median of "
        f"{summary['timed_tokens']}), {summary['loop_token_median_s'] * 1e3:.3f} ms per token in the generation "
        f"loop, prefill of {lengths['inputs']} tokens {summary['prefill_median_s'] * 1e3:.1f} ms"
    )
    print(f"\nruns, metrics.jsonl, TensorBoard events and config.gin are under {out}")
    return 0


COMMAND = app.command("terra-quickstart", "terra.cli.quickstart", __doc__, define_flags=define_flags, run=run)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
