"""Decode a split from a checkpoint and score it: ROUGE-1/2/LSum/LSent and log-perplexity.

Name the run with --checkpoint MODEL_DIR (its own config.gin gives the model, task and lengths),
or name its experiment with --gin_file and --gin.MODEL_DIR. Writes predictions.jsonl and
metrics.json to MODEL_DIR/eval/<split>_step<step>/ (or --output_dir), the folder's name followed
by every setting that changes the results (e.g. _int8, _t0.5_seed1_batch8, _first100, _len64), and
adds a line to the run's table of evaluations (MODEL_DIR/eval/results.jsonl), which --list prints.
A folder that holds an evaluation already is refused unless --overwrite. Decoding is greedy unless
--temperature is set (the paper sampled its arXiv abstracts at 0.5).

  terra-evaluate --checkpoint runs/quickstart/finetune
  terra-evaluate --checkpoint /runs/terraformer_arxiv --split test --temperature 0.5 --seed 1 \\
      --tfds_data_dir=/data/tfds --vocabulary=vocab/c4-32k.model
  terra-evaluate --list runs/quickstart/finetune        # every evaluation of the run, one line each
"""

from absl import flags

from terra import errors
from terra.cli import app, flag_groups

# Flags passed on to terra.evaluation.evaluate when given.
OVERRIDES = (
    "step",
    "split",
    "num_examples",
    "batch_size",
    "max_decode_length",
    "temperature",
    "seed",
    "output_dir",
    "weights_dtype",
    "overwrite",
)


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_gin_flags(flag_values)
    flag_groups.define_data_flags(flag_values)
    flags.DEFINE_string(
        "checkpoint",
        None,
        "a terra MODEL_DIR: its config.gin configures the evaluation and its checkpoints are read",
        flag_values=flag_values,
    )
    flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)", flag_values=flag_values)
    flags.DEFINE_string("split", None, "task split (default: validation)", flag_values=flag_values)
    flags.DEFINE_integer("num_examples", None, "only the first N examples", flag_values=flag_values)
    flags.DEFINE_integer("batch_size", None, "examples decoded together", flag_values=flag_values)
    flags.DEFINE_integer(
        "max_decode_length",
        None,
        "most tokens decoded per example (default: the task's target length)",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "temperature", None, "0 = greedy (the default); the paper sampled at 0.5", flag_values=flag_values
    )
    flags.DEFINE_integer("seed", None, "sampling seed", flag_values=flag_values)
    flags.DEFINE_string("output_dir", None, "where predictions.jsonl and metrics.json go", flag_values=flag_values)
    flags.DEFINE_bool(
        "force", False, "score a run whose task is not a summarization task anyway", flag_values=flag_values
    )
    flag_groups.define_weights_dtype_flag(flag_values, default=None)
    flags.DEFINE_bool("overwrite", None, "replace the evaluation already in the output folder", flag_values=flag_values)
    flags.DEFINE_string(
        "list", None, "print the evaluations of run MODEL_DIR, one line each, and exit", flag_values=flag_values
    )
    flags.register_multi_flags_validator(["checkpoint", "gin_file", "list"], _check_run_named, flag_values=flag_values)


def _check_run_named(values) -> bool:
    """The run is named (a flag error, reported before anything heavy is imported)."""
    if values["list"] is not None:
        if values["checkpoint"] or values["gin_file"]:
            raise errors.UsageError("--list MODEL_DIR prints a run's evaluations: give it alone, without --checkpoint.")
        return True
    if not values["checkpoint"] and not values["gin_file"]:
        raise errors.UsageError("name the run: --checkpoint MODEL_DIR, or --gin_file=EXPERIMENT --gin.MODEL_DIR=...")
    return True


def run(flag_values: flags.FlagValues, _) -> int:
    if flag_values.list is not None:
        from terra import evaluation_table

        print(evaluation_table.markdown(flag_values.list))
        return 0
    from terra.evaluation import evaluator
    from terra.gin_config import parsing
    from terra.training import run_directory

    gin = flag_groups.gin_arguments(flag_values)
    files, bindings = gin["gin_files"], flag_groups.data_bindings(flag_values) + gin["gin_bindings"]
    if flag_values.checkpoint:
        config = None if files else run_directory.read_config(flag_values.checkpoint)  # checked as data
        files = files or [config]
        # The run's own MODEL_DIR and vocabulary copy, then the user's flags (which win).
        bindings = [*run_directory.load_bindings(flag_values.checkpoint, config, bindings), *bindings]
    parsing.parse_gin([*files, "runs/evaluate.gin"], bindings, search_paths=gin["search_paths"])
    overrides = {k: flag_values[k].value for k in OVERRIDES if flag_values[k].value is not None}
    try:
        evaluator.evaluate(**overrides, **({"force": True} if flag_values.force else {}))
    except RuntimeError as e:
        if "Required bindings" in str(e):
            raise parsing.explain_gin_error(e, "running terra-evaluate") from None
        raise
    return 0


def gin_files(flag_values: flags.FlagValues):
    """What ``run`` parses before the bindings; ``None`` when that is not known yet (``run``
    then reports the missing config)."""
    files = list(flag_values.gin_file)
    if not files and flag_values.checkpoint:
        files = flag_groups.run_config_files(flag_values.checkpoint)
    return [*files, "runs/evaluate.gin"] if files else None


COMMAND = app.command(
    "terra-evaluate",
    "terra.cli.evaluate",
    __doc__,
    define_flags=define_flags,
    run=run,
    gin_files=gin_files,
    reads_data=lambda flag_values: flag_values.list is None,  # --list reads only the run's table
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
