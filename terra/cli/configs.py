"""The shipped gin configs, one line each, and the config a command line gives, printed whole.

  terra-configs                                          # models, sizes, tasks, runs, experiments, presets
  terra-configs --gin_file=experiments/pretrain_c4_terraformer_800m.gin --gin.TRAIN_STEPS=1000

Without --gin_file it lists every shipped gin file by folder with the first sentence of its
header comment, and the decode-benchmark presets (terra-bench decode --preset NAME). With
--gin_file (and --gin.NAME=VALUE bindings) it parses them as terra-train would and prints the
resulting config, every binding with the command line's applied (gin's ``config_str``), before a
long run is started with them; nothing is built or written.
"""

import re

from absl import flags

from terra.cli import app, flag_groups


def define_flags(flag_values: flags.FlagValues, argv) -> None:
    flag_groups.define_gin_flags(
        flag_values, files_help="gin files whose parsed config to print (default: list the shipped configs)"
    )
    flag_groups.define_data_flags(flag_values)


def summary_line(text: str, width: int = 96) -> str:
    """The first sentence of a gin file's header comment (its leading ``#`` lines), at most
    ``width`` characters."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    sentence = " ".join(words)
    end = re.search(r"\.(\s|$)", sentence)
    sentence = sentence[: end.start() + 1] if end else sentence
    return sentence if len(sentence) <= width else sentence[: width - 1].rstrip() + "…"


def listing() -> str:
    """Every shipped gin file by folder, and the decode presets, one line each."""
    import os

    from terra.benchmarks.presets import PRESETS
    from terra.gin_config import parsing

    lines = []
    for folder in parsing.CONFIG_FOLDERS:
        lines.append(f"{folder}/")
        for name in parsing.shipped_configs(folder):
            with open(os.path.join(parsing.CONFIGS_DIR, name), encoding="utf-8") as f:
                lines.append(f"  {name:<52} {summary_line(f.read())}")
    lines.append("presets (terra-bench decode --preset NAME)")
    for name, preset in PRESETS.items():
        header = "\n".join(f"# {line.strip()}" for line in (preset.__doc__ or "").strip().splitlines())
        lines.append(f"  {name:<52} {summary_line(header)}")
    return "\n".join(lines)


def run(flag_values: flags.FlagValues, _) -> int:
    gin = flag_groups.gin_arguments(flag_values)
    if not gin["gin_files"]:
        print(listing())
        return 0
    import gin as gin_lib

    from terra.gin_config import parsing

    bindings = flag_groups.data_bindings(flag_values) + gin["gin_bindings"]
    parsing.parse_gin(gin["gin_files"], bindings, finalize=False, search_paths=gin["search_paths"])
    print(f"# {' + '.join(gin['gin_files'])}" + (f" with {len(bindings)} binding(s)" if bindings else ""))
    print(gin_lib.config_str())
    return 0


COMMAND = app.command(
    "terra-configs",
    "terra.cli.configs",
    __doc__,
    define_flags=define_flags,
    run=run,
    gin_files=lambda flag_values: list(flag_values.gin_file) or None,
)
main, call = COMMAND.main, COMMAND.call

if __name__ == "__main__":
    raise SystemExit(main())
