"""Pretrain or fine-tune a model from gin files (the T5X form).

Name the gin files (model, task and run; or one experiment that includes them) and override any
binding on the command line. Data locations come as flags. Rerunning the same command resumes
the run from its latest checkpoint.

  terra-train --gin_file=experiments/quickstart.gin --gin.MODEL_DIR="'runs/quick'"
  terra-train --gin_file=experiments/pretrain_c4_dense_800m.gin --gin.MODEL_DIR="'/runs/dense'" \\
      --c4_json=/data/c4/en --vocabulary=vocab/c4-32k.model
  terra-train --gin_file=experiments/quickstart_finetune.gin --gin.INIT_FROM="'runs/quick'" \\
      --gin.MODEL_DIR="'runs/quick_ft'"

Multi-host: one process per host with --coordinator host:port --num_processes N --process_id i
(or TERRA_COORDINATOR, TERRA_NUM_PROCESSES, TERRA_PROCESS_ID in the environment);
scripts/launch_local_multihost.sh shows it on one machine.
"""

from absl import flags

from terra.cli import app, flag_groups


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_gin_flags(flag_values)
    flag_groups.define_data_flags(flag_values)
    flags.DEFINE_string("coordinator", None, "host:port of process 0 (multi-host)", flag_values=flag_values)
    flags.DEFINE_integer("num_processes", None, "number of processes (multi-host)", flag_values=flag_values)
    flags.DEFINE_integer("process_id", None, "this process's index (multi-host)", flag_values=flag_values)


def run(flag_values: flags.FlagValues, _) -> int:
    from terra.parallel import mesh

    # Before anything creates the JAX backend.
    mesh.initialize_distributed(
        coordinator_address=flag_values.coordinator,
        num_processes=flag_values.num_processes,
        process_id=flag_values.process_id,
    )
    from terra.gin_config import parsing
    from terra.training import trainer

    gin = flag_groups.gin_arguments(flag_values)
    if not gin["gin_files"]:
        raise parsing.GinConfigError(
            "name the run's configs: --gin_file=experiments/NAME.gin (or model, task and "
            "run files); see terra-train --help."
        )
    parsing.parse_gin(
        gin["gin_files"], flag_groups.data_bindings(flag_values) + gin["gin_bindings"], search_paths=gin["search_paths"]
    )
    try:
        result = trainer.Trainer().run()
    except RuntimeError as e:
        if "Required bindings" in str(e):  # a %gin.REQUIRED macro or Trainer argument left unset
            raise parsing.explain_gin_error(e, "running terra-train") from None
        raise
    print(finish_line(result, gin["gin_files"]))
    return app.EXIT_INTERRUPTED if result.stopped_by == "SIGINT" else 0


def finish_line(result, gin_files) -> str:
    """What terra-train prints last: the step it reached and, after a signal, how to resume."""
    if result.stopped_by == "SIGINT":
        return (
            f"terra-train: interrupted at step {result.step}, saved in {result.model_dir}; rerun the same command "
            f"(--gin_file={gin_files[0]} ...) to resume from it."
        )
    preempted = " (preempted; rerun to resume)" if result.preempted else ""
    return f"terra-train: finished at step {result.step}{preempted}"


COMMAND = app.command(
    "terra-train",
    "terra.cli.train",
    __doc__,
    define_flags=define_flags,
    run=run,
    gin_files=lambda f: f.gin_file,
    reads_data=True,
    complete_config=True,
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
