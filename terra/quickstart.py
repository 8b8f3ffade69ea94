"""The quick start behind ``make run``: pretrain, fine-tune, summarize — on the embedded corpus.

  python -m terra.quickstart [--out runs/quickstart] [--pretrain_steps 300] [--finetune_steps 200]

1. Pretrains the tiny encoder-decoder of ``experiments/quickstart.gin`` with span corruption on
   the embedded corpus (Python's own documentation; nothing to download).
2. Fine-tunes it on the embedded summarization task (``experiments/quickstart_finetune.gin``:
   docstring body -> summary line), starting from the pretrained parameters.
3. Evaluates the fine-tuned model on the validation split as ``python -m terra.evaluate``
   does: greedy summaries through the jitted decode step, ROUGE-1/2/LSum/LSent F1 with
   ``rouge-score`` and log-perplexity (``<out>/finetune/eval/``); prints a few summaries and the
   batch-1 per-token latency.

Both runs are ordinary ``terra.train`` runs (checkpoints, metrics.jsonl, TensorBoard events,
config.gin under ``--out``); running the quick start again resumes them. Extra ``--gin.X=Y``
flags apply to both runs.
"""

import argparse
import os
import textwrap
from typing import List, Optional

import jax

from terra import gin_utils
from terra.benchmarks.decode_speed import measure_decode
from terra.evaluation import evaluator, summaries
from terra.training import metrics as metrics_lib
from terra.training import trainer


def _losses(model_dir: str, key: str) -> List[float]:
    return [row[key] for row in metrics_lib.read_metrics(model_dir) if key in row]


def _run(gin_file: str, model_dir: str, steps: int, bindings: List[str]) -> trainer.TrainResult:
    gin_utils.parse_gin([gin_file], [f"MODEL_DIR = {model_dir!r}", f"TRAIN_STEPS = {steps}", *bindings])
    return trainer.Trainer().run()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m terra.quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/quickstart")
    parser.add_argument("--pretrain_steps", type=int, default=300)
    parser.add_argument("--finetune_steps", type=int, default=200)
    parser.add_argument("--examples", type=int, default=3, help="validation summaries to print")
    parser.add_argument("--eval_examples", type=int, default=None,
                        help="validation examples to score with ROUGE (default: the whole split)")
    parser.add_argument("--max_decode_length", type=int, default=32)
    gin_utils.add_gin_flags(parser)
    args, _ = parser.parse_known_args([a for a in (argv or []) if not a.startswith("--gin.")])
    extra, _ = gin_utils.split_gin_args(argv or [])
    extra = list(args.gin_bindings) + extra
    pretrain_dir = os.path.join(args.out, "pretrain")
    finetune_dir = os.path.join(args.out, "finetune")

    print(f"== 1/3 pretraining on the embedded corpus (span corruption) -> {pretrain_dir}")
    _run("experiments/quickstart.gin", pretrain_dir, args.pretrain_steps, extra)
    losses = _losses(pretrain_dir, "train/loss")
    print(f"   train loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    print(f"== 2/3 fine-tuning on embedded summarization -> {finetune_dir}")
    result = _run("experiments/quickstart_finetune.gin", finetune_dir, args.finetune_steps,
                  [f"INIT_FROM = {pretrain_dir!r}", *extra])
    evals = _losses(finetune_dir, "eval/loss")
    if evals:
        print(f"   eval log-perplexity {evals[0]:.3f} -> {evals[-1]:.3f} (nats per target token)")

    print("== 3/3 evaluating on the validation split: greedy summaries, ROUGE (rouge-score), log-perplexity")
    model = gin_utils.build_model()
    lengths = gin_utils.gin.query_parameter("%TASK_FEATURE_LENGTHS")
    evaluation = evaluator.evaluate(model=model, task="embedded_summarization", feature_lengths=lengths,
                                    model_dir=finetune_dir, batch_size=16, max_decode_length=args.max_decode_length,
                                    num_examples=args.eval_examples, log=lambda s: print(textwrap.indent(s, "   ")))
    for row in evaluation.predictions[: args.examples]:
        print(f"\n  document : {row['input'][:160].replace(chr(10), ' ')}{'...' if len(row['input']) > 160 else ''}")
        print(f"  reference: {row['target']}")
        print(f"  summary  : {row['prediction']}")
    first_input = summaries.pad_batch([evaluation.examples[0].inputs], 1, lengths["inputs"])
    timing = measure_decode(model.decoder(args.max_decode_length), jax.device_get(result.params), first_input,
                            n_tokens=min(12, args.max_decode_length))
    summary = timing.summary()
    print(f"\nbatch-1 decode: {summary['token_median_s'] * 1e3:.3f} ms per token as one step call each (median of "
          f"{summary['timed_tokens']}), {summary['loop_token_median_s'] * 1e3:.3f} ms per token in the generation loop, "
          f"prefill of {lengths['inputs']} tokens {summary['prefill_median_s'] * 1e3:.1f} ms")
    print(f"\nruns, metrics.jsonl, TensorBoard events and config.gin are under {args.out}")
    return 0


if __name__ == "__main__":
    import sys

    gin_utils.run_cli(lambda: main(sys.argv[1:]))
