"""Parameter counts and the weights one decoded token reads, from abstract shapes.

Nothing is allocated: a model config is traced abstractly (about a second per 800M config).
"Read per token" is what a batch-1 decode step streams from memory.

  terra-params --gin_file=models/dense_800m.gin     # one config, by group
  terra-params --all                                # every shipped model config (about 30 s)
"""

from absl import flags

from terra.cli import app, flag_groups


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_gin_flags(flag_values, files_help="model config(s) to count (default: models/dense_800m.gin)")
    flags.DEFINE_bool("all", False, "summarise every shipped model config (models/*.gin)", flag_values=flag_values)


def run(flag_values: flags.FlagValues, _) -> int:
    from terra.benchmarks import param_count

    gin = flag_groups.gin_arguments(flag_values)
    if flag_values.all:
        print(f"{'config':<36} {'params':>14} {'read / token':>14} {'float32 MB / token':>19}")
        for row in param_count.all_model_counts(gin["gin_bindings"]):
            print(
                f"{row['config']:<36} {row['params']:>14,d} {row['read_per_token']:>14,d} "
                f"{row['read_per_token'] * 4 / 1e6:>19.1f}"
            )
        return 0
    files = gin["gin_files"] or ["models/dense_800m.gin"]
    counts = param_count.model_counts(files, gin["gin_bindings"], gin["search_paths"])
    print(f"Parameters of {', '.join(files)} (from abstract shapes, nothing allocated):")
    for name, n in counts["params"].items():
        print(f"  {name:<28} {n:>15,d}")
    closed, total = counts["closed_form"], counts["params"]["total"]
    verdict = "matches" if closed == total else "differs: the closed form is for the dense baseline"
    print(f"  {'dense closed form':<28} {closed:>15,d}  ({verdict})")
    print(f"  float32 bytes: {total * 4 / 2**30:.2f} GiB")
    print("Read per decoded token (batch 1):")
    for name, n in counts["read_per_token"].items():
        print(f"  {name:<28} {n:>15,d}")
    return 0


def gin_files(flag_values: flags.FlagValues):
    """The model config ``run`` parses; each shipped one in turn with --all (not checked)."""
    return None if flag_values.all else (flag_values.gin_file or ["models/dense_800m.gin"])


COMMAND = app.command(
    "terra-params", "terra.cli.params", __doc__, define_flags=define_flags, run=run, gin_files=gin_files
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
