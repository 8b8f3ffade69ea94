"""``python -m terra.evaluate``: decode a split from a checkpoint, score ROUGE and log-perplexity.

Gin-configured like training: name the run's experiment config (and its ``MODEL_DIR``), or
just ``--checkpoint MODEL_DIR`` to reuse the ``config.gin`` the run wrote. Writes
``predictions.jsonl`` and ``metrics.json`` (default ``MODEL_DIR/eval/<split>_step<step>/``).

Examples::

  python -m terra.evaluate --checkpoint runs/quickstart/finetune
  python -m terra.evaluate --gin_file=experiments/finetune_arxiv_terraformer.gin \\
      --gin.MODEL_DIR="'/runs/terraformer_arxiv'" --split test --temperature 0.5 --seed 1 \\
      --tfds_data_dir=/data/tfds --vocabulary=vocab/c4-32k.model
"""

import argparse
import os
import sys
from typing import Optional, Sequence

from terra import gin_utils
from terra.errors import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m terra.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None,
                        help="a terra model_dir: its config.gin configures the evaluation and its checkpoints are read")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--split", default=None, help="task split (default: validation)")
    parser.add_argument("--num_examples", type=int, default=None, help="only the first N examples")
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--max_decode_length", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default); the paper used 0.5")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--force", action="store_true", default=None,
                        help="score a run whose task is not a summarization task anyway")
    gin_utils.add_gin_flags(parser)
    from terra.data import tasks  # registers the data configurables before gin is parsed

    tasks.add_data_flags(parser)
    args_list = list(sys.argv[1:] if argv is None else argv)
    known, _ = parser.parse_known_args([a for a in args_list if not a.startswith("--gin.")])
    from terra import api
    from terra.evaluation import evaluator

    files = list(known.gin_file)
    if known.checkpoint:
        files = files or [api.run_config_path(known.checkpoint)]
        args_list.append(f"--gin.MODEL_DIR={os.path.abspath(known.checkpoint)!r}")
    if not files:
        raise ConfigError("name the run: --checkpoint MODEL_DIR, or --gin_file=EXPERIMENT --gin.MODEL_DIR=...")
    args_list = [a for a in args_list if not a.startswith("--gin_file")] + [f"--gin_file={f}" for f in files]
    args_list.append("--gin_file=runs/evaluate.gin")
    gin_utils.parse_flags(parser, args_list, flag_bindings=tasks.data_flag_bindings)
    overrides = {k: getattr(known, k) for k in ("step", "split", "num_examples", "batch_size", "max_decode_length",
                                               "temperature", "seed", "output_dir", "force") if getattr(known, k) is not None}
    try:
        evaluator.evaluate(**overrides)
    except RuntimeError as e:
        if "Required bindings" in str(e):
            raise gin_utils.explain_gin_error(e, "running terra.evaluate") from None
        raise
    return 0


if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
