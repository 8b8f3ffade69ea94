"""The command line: every command answers --help and --version at once, without importing the
heavy stack; its help names the command as the user types it and lists every flag and every
--config field with its default; a bad flag is one line and exit status 2; the console scripts
match the command modules; library modules have no command line of their own."""

import ast
import configparser
import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
from absl import flags

import terra
from terra.benchmarks import presets as bench_presets
from terra.cli import bench, data, evaluate, params, quickstart, reproduce, summarize, train, vocab
from terra.reproduce import presets as study_presets

from conftest import REPO_ROOT

COMMANDS = {
    "terra-train": train,
    "terra-evaluate": evaluate,
    "terra-summarize": summarize,
    "terra-bench": bench,
    "terra-reproduce": reproduce,
    "terra-data": data,
    "terra-params": params,
    "terra-vocab": vocab,
    "terra-quickstart": quickstart,
}
# Every command line that has flags of its own: (module, subcommand or None).
LEAVES = [(m, None) for m in COMMANDS.values() if not m.COMMAND.subcommands] + [
    (m, sub) for m in COMMANDS.values() for sub in m.COMMAND.subcommands
]
HEAVY = ("jax", "tensorflow", "seqio", "flax", "orbax", "optax", "terra.models", "terra.data")


def _help(module, sub=None, *extra) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert module.call([*([sub] if sub else []), *extra, "--help"]) == 0
    return printed.getvalue()


def test_every_console_script_is_a_command_module_and_names_itself():
    parser = configparser.ConfigParser()
    parser.read(os.path.join(REPO_ROOT, "setup.cfg"))
    lines = [line.strip() for line in parser["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    scripts = dict(line.split(" = ") for line in lines)
    assert scripts == {name: f"{module.__name__}:main" for name, module in COMMANDS.items()}
    for name, module in COMMANDS.items():
        assert module.COMMAND.name == name and module.main == module.COMMAND.main
    cli_dir = os.path.join(os.path.dirname(terra.__file__), "cli")
    command_modules = {f"terra.cli.{f[:-3]}" for f in os.listdir(cli_dir) if f.endswith(".py")} - {
        "terra.cli.__init__",
        "terra.cli.app",
        "terra.cli.flag_groups",
    }
    assert command_modules == {m.__name__ for m in COMMANDS.values()}


@pytest.mark.parametrize("module, sub", LEAVES, ids=[f"{m.COMMAND.name} {s or ''}".strip() for m, s in LEAVES])
def test_help_names_the_command_and_describes_every_flag(module, sub):
    text = _help(module, sub)
    name = module.COMMAND.name + (f" {sub}" if sub else "")
    assert text.startswith(f"usage: {name} [flags]") and f"python -m {module.__name__}" in text
    command = module.COMMAND.subcommands[sub] if sub else module.COMMAND
    flag_values = flags.FlagValues()
    command.define_flags(flag_values, [])
    for flag in set(flag_values):
        if "." not in flag:
            assert f"--{flag}" in text, flag


def _fields(config, prefix=""):
    for key, value in config.items():
        if hasattr(value, "items") and not isinstance(value, dict):
            yield from _fields(value, f"{prefix}{key}.")
        elif key != "rows":
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("preset", sorted(bench_presets.PRESETS))
def test_decode_benchmark_help_lists_every_config_field_of_the_preset_with_its_default(preset):
    text = _help(bench, "decode", "--preset", preset)
    for field, value in _fields(bench_presets.PRESETS[preset]()):
        assert f"--config.{field}={value!r}" in text if isinstance(value, str) else f"--config.{field}={value}" in text
    assert f"{len(bench_presets.PRESETS[preset]().rows)} rows" in text


@pytest.mark.parametrize(
    "study, preset",
    [("sparsity", p) for p in study_presets.SPARSITY_PRESETS]
    + [("length_generalization", p) for p in study_presets.LENGTH_PRESETS],
)
def test_study_help_lists_every_config_field_of_the_preset_with_its_default(study, preset):
    text = _help(reproduce, study, "--preset", preset)
    presets = study_presets.SPARSITY_PRESETS if study == "sparsity" else study_presets.LENGTH_PRESETS
    for field, value in _fields(presets[preset]()):
        assert (f"--config.{field}={value!r}" if isinstance(value, str) else f"--config.{field}={value}") in text


def test_config_overrides_reach_the_chosen_preset():
    from terra.cli import flag_groups

    argv = ["--preset", "tiny", "--config.tokens=20", "--config.weights_dtype=bfloat16"]
    flag_values = flags.FlagValues()
    flag_groups.define_preset_flags(flag_values, argv, bench_presets.PRESETS, "paper_800m", "decode-speed")
    flag_values(["terra-bench", *argv])
    assert flag_values.config.tokens == 20 and flag_values.config.weights_dtype == "bfloat16"
    assert [r.name for r in flag_values.config.rows] == [r.name for r in bench_presets.tiny().rows]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["decode", "--nosuch"], "Unknown command line flag 'nosuch'"),
        (["decode", "--config.tokenz=3"], "unknown --config field 'tokenz'. Did you mean \"tokens\""),
        (["decode", "--config.tokens=many"], "--config.tokens=many: invalid literal for int"),
        (["decode", "--preset", "paper_900m"], "unknown preset 'paper_900m'"),
        (["decdoe"], "Did you mean 'decode'?"),
        ([], "name a subcommand"),
        (["decode", "--gin.TransformerConfig.d_ff"], "write --gin.NAME=VALUE"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_status_2(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_missing_arguments_and_required_flags_are_usage_errors(capsys):
    assert summarize.main(["--checkpoint", "runs/x"]) == 2
    assert "missing FILE..." in capsys.readouterr().err
    assert summarize.main(["doc.txt"]) == 2
    assert "--checkpoint must have a value" in capsys.readouterr().err
    assert params.main(["unexpected"]) == 2
    assert "unexpected argument(s) unexpected" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_version_prints_terras_version(name, capsys):
    assert COMMANDS[name].main(["--version"]) == 0
    assert capsys.readouterr().out == f"terra {terra.__version__}\n"


def test_help_imports_neither_jax_nor_tensorflow_nor_seqio():
    """Every command's and subcommand's --help in a fresh interpreter, which then lists the
    heavy modules it loaded: none."""
    calls = "\n".join(f"run({m.__name__!r}, {s!r})" for m, s in LEAVES + [(m, None) for m in COMMANDS.values()])
    script = (
        "import contextlib, importlib, io, json, sys\n"
        "def run(name, sub):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert importlib.import_module(name).call(([sub] if sub else []) + ['--help']) == 0\n"
        f"{calls}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_a_console_command_answers_help_within_seconds():
    command = os.path.join(os.path.dirname(sys.executable), "terra-bench")
    start = time.perf_counter()
    result = subprocess.run([command, "decode", "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and "--config.tokens=12" in result.stdout, result.stderr
    assert elapsed < 10, f"--help took {elapsed:.1f} s"  # 0.1-0.2 s on 2 cores; the heavy imports alone take 10+


def test_no_library_module_has_a_command_line():
    """argparse, absl flags, ``main()`` and ``__main__`` blocks live in terra/cli only."""
    package = os.path.dirname(terra.__file__)
    problems = []
    for root, _, files in os.walk(package):
        if os.path.relpath(root, package).split(os.sep)[0] == "cli":
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                imported = []
                if isinstance(node, ast.Import):
                    imported = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    imported = [f"{node.module}.{a.name}" for a in node.names]
                if any(n.startswith(("argparse", "absl.flags", "absl.app")) for n in imported):
                    problems.append(f"{path}: imports {imported}")
                if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                    problems.append(f"{path}:{node.lineno}: a __main__ block")
            problems += [f"{path}: def main" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert not problems, "\n".join(problems)


def test_the_vocab_commands_default_size_is_the_embedded_vocabularys():
    from terra.data import vocabularies

    flag_values = flags.FlagValues()
    vocab.define_flags(flag_values, [])
    assert flag_values["vocab_size"].default == vocabularies.DEFAULT_EMBEDDED_VOCAB_SIZE
