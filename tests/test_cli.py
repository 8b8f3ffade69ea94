"""The command line: every command answers --help and --version at once, without importing the
heavy stack; its help names the command as the user types it and lists every flag and every
--config field with its default; a bad flag is one line and exit status 2, and so is a --gin
override that no config declares, of the wrong type or unquoted, reported before TensorFlow
loads; each class of failure has one exit status; the console scripts match the command
modules; library modules have no command line of their own."""

import ast
import configparser
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from absl import flags

import terra
from terra import errors
from terra.benchmarks import presets as bench_presets
from terra.cli import (
    app,
    bench,
    configs,
    convert,
    data,
    evaluate,
    params,
    quickstart,
    reproduce,
    summarize,
    train,
    vocab,
)
from terra.gin_config import override_checks
from terra.gin_config.parsing import GinConfigError
from terra.reproduce import presets as study_presets

from helpers import REPO_ROOT

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
    "terra-convert": convert,
    "terra-configs": configs,
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
        "terra.gin_config.override_checks",
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
        (["decode", "--preset", "tiny", "--rows=nosuch"], "no row's name contains any of ['nosuch']; the rows are: "),
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
    assert "give exactly one of --checkpoint=MODEL_DIR" in capsys.readouterr().err
    assert params.main(["unexpected"]) == 2
    assert "unexpected argument(s) unexpected" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give exactly one of --checkpoint=MODEL_DIR (a trained run) and --random_weights"),
        (["--checkpoint=runs/x", "--random_weights", "--gin_file=models/tiny.gin"], "give exactly one of"),
        (["--random_weights"], "--random_weights needs the model and task: --gin_file="),
        (["--checkpoint=runs/x", "--gin_file=models/tiny.gin"], "--gin_file is for --random_weights"),
        (["--random_weights", "--gin_file=models/tiny.gin", "--step=3"], "--step names a checkpoint's step"),
        (["--checkpoint=runs/x", "--cache_dtype=int4"], "--cache_dtype=int4: value should be one of"),
    ],
)
def test_summarize_takes_exactly_one_of_a_checkpoint_and_random_weights(argv, message, no_tensorflow, capsys):
    assert summarize.main([*argv, "doc.txt"]) == app.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert err.count("error:") == 1 and "flags checkpoint=" not in err, err  # no absl list of values
    assert "Exit status: 0 done; 2 a bad command line" in summarize.__doc__


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


def test_the_weights_dtype_flag_offers_exactly_the_stores_quantization_has():
    from terra.cli import flag_groups
    from terra.quantization import WEIGHTS_DTYPES

    assert flag_groups.WEIGHTS_DTYPES == WEIGHTS_DTYPES


def test_the_cache_dtype_flag_offers_exactly_the_stores_the_caches_have():
    from terra.backends.decode_state import CACHE_DTYPES
    from terra.cli import flag_groups

    assert flag_groups.CACHE_DTYPES == CACHE_DTYPES


@pytest.mark.slow
def test_summarize_with_random_weights_prints_noise_and_the_timings(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("we study sparse layers in a model .\nthe sparse layers make decoding fast .\n")
    argv = [
        "--random_weights",
        "--gin_file=models/tiny.gin",
        "--gin_file=tasks/embedded_summarization.gin",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
        "--gin.TransformerConfig.vocab_size=4224",
        "--weights_dtype=int8",
        "--max_decode_length=3",
        "--batch_size=1",
    ]
    from terra.models import TransformerConfig

    if "cache_dtype" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        argv.append("--cache_dtype=int8")  # TransformerConfig.cache_dtype = 'int8'
    assert summarize.main([*argv, str(doc), str(doc)]) == 0
    out, err = capsys.readouterr()
    assert out.count("(random weights)") == 2
    assert "note: --random_weights: the weights are random, so the summaries are noise" in err
    phases = [line for line in err.splitlines() if line.startswith("timing: ") and "ms/token" not in line]
    assert len(phases) == 3 and "batch 1/2: compiled the prefill and the generation loop in " in phases[0]
    assert "batch 1/2: prefill of " in phases[1] and "batch 2/2: prefill of " in phases[2]
    lines = [line for line in err.splitlines() if line.startswith("timing: ") and "ms/token" in line]
    assert len(lines) == 2 and lines[0].startswith("timing: batch 1/2: 1 document, ") and "batch 2/2" in lines[1]
    for line in lines:
        assert re.search(r"\d+ input tokens \(padded to \d+ per document\); prefill [\d.]+ s; ", line), line
        assert re.search(r"; 3 tokens generated per document in [\d.]+ s = [\d.]+ ms/token \(in the loop\)", line)
        assert re.search(r"; peak resident memory [\d.]+ GiB$", line), line
    assert "compile" in lines[0] and "compile" not in lines[1]  # compiled once, ahead of the first batch's times
    assert "generate:" not in err  # the timing lines replace the progress bar
    missing = tmp_path / "vocab" / "cc_all.32000.model"  # the paper's vocabulary, not shipped
    assert summarize.main([*argv, f"--vocabulary={missing}", str(doc)]) == app.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: SentencePiece model not found: '{missing}'") and "terra-vocab" in err, err
    assert err.count("\n") == 1, err


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


# --- --gin overrides, checked against the configs before anything heavy is imported ----------------

QUICKSTART = "--gin_file=experiments/quickstart.gin"


def _heavy_modules_after(call: str) -> str:
    """A script that runs ``call`` (a command's ``main``), prints the heavy modules then loaded
    and exits with the command's status."""
    return (
        "import json, sys\n"
        "from terra.cli import bench, evaluate, params, train\n"
        f"status = {call}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r})))\n"
        "sys.exit(status)\n"
    )


def test_a_misspelled_macro_is_an_error_with_a_did_you_mean_before_tensorflow_loads(tmp_path):
    argv = [QUICKSTART, "--gin.TRAIN_STEPZ=10", f"--gin.MODEL_DIR='{tmp_path / 'run'}'"]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", _heavy_modules_after(f"train.main({argv!r})")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: --gin.TRAIN_STEPZ=10 sets a macro no config declares. Did you mean TRAIN_STEPS? "
        "Macros declared by experiments/quickstart.gin: BATCH_SIZE, FEATURE_CONVERTER, INIT_FROM, MODEL, MODEL_DIR,"
    )
    assert json.loads(result.stdout) == [] and not (tmp_path / "run").exists()
    assert elapsed < 10, f"took {elapsed:.1f} s"  # about 0.1 s on 2 cores; TensorFlow alone takes 10+


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--gin.TRAIN_STEPS='ten'",
            "error: --gin.TRAIN_STEPS='ten' is a str, but TRAIN_STEPS is an int in "
            "terra/configs/experiments/quickstart.gin (default 300): give an int, e.g. --gin.TRAIN_STEPS=300.\n",
        ),
        ("--gin.TRAIN_STEPS=1e4", "error: --gin.TRAIN_STEPS=1e4 is a float, but TRAIN_STEPS is an int"),
        (
            "--gin.TASK_FEATURE_LENGTHS=128",
            "is an int, but TASK_FEATURE_LENGTHS is a dict in terra/configs/tasks/embedded_span_corruption.gin "
            "(default {'inputs': 128, 'targets': 32}): give a dict, e.g. "
            "--gin.TASK_FEATURE_LENGTHS=\"{'inputs': 128, 'targets': 32}\"",
        ),
    ],
    ids=["str for int", "float for int", "int for dict"],
)
def test_a_wrong_typed_macro_is_one_paragraph_naming_the_binding_and_the_expected_type(
    override, message, no_tensorflow, capsys
):
    assert train.main([QUICKSTART, override, "--gin.MODEL_DIR='runs/x'"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "command, argv, hint",
    [
        (
            train,
            [QUICKSTART, "--gin.MODEL_DIR=runs/x"],
            "error: --gin.MODEL_DIR=runs/x: gin values are Python literals; "
            "quote strings: --gin.MODEL_DIR=\"'runs/x'\"",
        ),
        (
            bench,
            ["decode", "--preset", "tiny", "--gin.TransformerConfig.dtype=bfloat16"],
            "quote strings: --gin.TransformerConfig.dtype=\"'bfloat16'\"",
        ),
        (
            train,
            [QUICKSTART, "--gin.EncoderDecoderTransformer.feed_forward=SparseFeedForward"],
            "(or @SparseFeedForward for a configurable)",
        ),
        (train, [QUICKSTART, "--gin.TASK_FEATURE_LENGTHS={'inputs': 8"], "gin cannot parse this binding"),
    ],
    ids=["a path", "a word", "a configurable without @", "an unclosed dict"],
)
def test_an_unquoted_string_gets_a_hint_to_quote_it_and_a_bad_value_names_the_literal_forms(
    command, argv, hint, no_tensorflow, capsys
):
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "text, where",
    [
        (
            "TransformerConfig.d_ff = 96\nTASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': [8\n",
            "EOF in multi-line statement: the '{' on line 2 is never closed",
        ),
        (
            "# a comment's ( and '\nX = 'a(b'\nY = [1,\n\nZ = 3\n",
            "the '[' on line 3 is never closed (gin gave up on line 5)",
        ),
        ('X = """abc\nY = 2\n', "EOF in multi-line string: the string on line 1 is never closed"),
    ],
    ids=["at the end", "before gin gave up", "a string"],
)
def test_a_gin_file_with_an_unclosed_bracket_names_the_line_it_opened_on(text, where, tmp_path, no_tensorflow, capsys):
    (tmp_path / "bad.gin").write_text(text)
    assert configs.main([f"--gin_file={tmp_path / 'bad.gin'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: Invalid gin configuration (file {tmp_path / 'bad.gin'}): ") and where in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "binding",
    [
        "TRAIN_STEPS = 10",
        "MODEL_DIR = 'runs/x'",  # %gin.REQUIRED in runs/train.gin: any value
        "TASK_FEATURE_LENGTHS = {'inputs': 64, 'targets': 16}",
        "MODEL = @terra.models.TerraformerModel()",  # a reference: its type is known at run time only
        "TRAIN_STEPS = %BATCH_SIZE",
        "TransformerConfig.d_model = 64",  # a parameter: checked once its configurable is imported
    ],
)
def test_overrides_the_configs_declare_with_values_of_their_type_pass(binding):
    override_checks.check_overrides([binding], ["experiments/quickstart.gin"])


def test_a_users_config_is_read_with_its_includes_and_the_macros_it_only_uses(tmp_path):
    (tmp_path / "mine.gin").write_text("include 'models/tiny.gin'\nRATE = 0.5\nTrainer.init_from = %FROM_CLI\n")
    macros = override_checks.declared_macros(["mine.gin"], [str(tmp_path)])
    assert {"MODEL", "RATE", "FROM_CLI"} <= set(macros.names)  # MODEL from dense_800m.gin, two includes down
    override_checks.check_overrides(["RATE = 1", "FROM_CLI = 'runs/x'"], ["mine.gin"], [str(tmp_path)])  # int for float
    with pytest.raises(GinConfigError, match=r"--gin.RATE='fast' is a str, but RATE is a float in .*mine.gin"):
        override_checks.check_overrides(["RATE = 'fast'"], ["mine.gin"], [str(tmp_path)])
    with pytest.raises(GinConfigError, match="Did you mean RATE?"):
        override_checks.check_overrides(["RATES = 1"], ["mine.gin"], [str(tmp_path)])


def test_a_config_the_reader_cannot_follow_is_left_to_the_full_parse(tmp_path):
    broken = tmp_path / "broken.gin"
    broken.write_text("include 'no/such/file.gin'\n")
    assert override_checks.declared_macros([str(broken)]) is None
    override_checks.check_overrides(["ANY_MACRO = 1"], [str(broken)])  # gin's parse reports the include
    with pytest.raises(GinConfigError, match="not found"):
        override_checks.check_overrides(["ANY_MACRO = 1"], ["no_such_experiment.gin"])


def test_evaluate_checks_overrides_against_the_runs_own_config(tmp_path, no_tensorflow, capsys):
    (tmp_path / "config.gin").write_text(
        "MODEL_DIR = 'x'\nTASK = 'embedded_summarization'\nTASK_FEATURE_LENGTHS = {'inputs': 8, 'targets': 4}\n"
    )
    assert evaluate.main(["--checkpoint", str(tmp_path), "--gin.TASK_FEATURE_LENGHTS={'inputs': 8}"]) == 2
    assert "Did you mean TASK_FEATURE_LENGTHS?" in capsys.readouterr().err


def test_configs_lists_every_shipped_gin_file_and_preset_in_one_line_each(no_tensorflow, capsys):
    from terra.gin_config import parsing

    assert configs.call([]) == 0
    lines = [line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    listed = dict(lines)
    shipped = {name for folder in parsing.CONFIG_FOLDERS for name in parsing.shipped_configs(folder)}
    assert len(listed) == len(lines) and set(listed) == shipped | set(bench_presets.PRESETS)
    assert (
        listed["models/tiny.gin"]
        == "A tiny dense encoder-decoder for tests and the quick start: runs in seconds on a laptop CPU."
    )
    assert listed["tiny"] == "Runs in seconds: a smoke test of the whole benchmark."  # a preset's docstring
    assert all(10 < len(text) <= 96 for text in listed.values()), [t for t in listed.values() if len(t) > 96]


def test_configs_prints_the_parsed_config_with_the_command_lines_bindings(capsys):
    assert configs.call(["--gin_file=models/tiny.gin", "--gin.TransformerConfig.d_ff=96"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# models/tiny.gin with 1 binding(s)\n") and "TransformerConfig.d_ff = 96\n" in out
    assert "TransformerConfig.d_model = " in out  # the size file's bindings, through its include
    with pytest.raises(GinConfigError, match="Did you mean 'd_ff'"):
        configs.call(["--gin_file=models/tiny.gin", "--gin.TransformerConfig.d_fff=96"])


def _fails_with(error):
    def run(flag_values, rest):
        raise error

    return app.command("terra-x", "terra.cli.x", "A command that fails.", define_flags=lambda f, a: None, run=run)


@pytest.mark.parametrize(
    "error, status",
    [
        (errors.UsageError("bad flag"), 2),
        (GinConfigError("bad binding"), 2),
        (errors.ConfigError("bad size"), 2),
        (errors.DataNotFoundError("no data"), 2),
        (errors.CheckpointError("no checkpoint"), 2),
        (errors.InputError("empty input"), 2),
        (errors.TrainingError("the loss diverged"), 1),
        (errors.StorageError("cannot save step 2: no space left on the device"), 1),
        (OSError(30, "Read-only file system", "/runs/r/config.gin"), 1),
        (OSError(28, "No space left on device", "/runs/r/metrics.jsonl"), 1),
        (KeyboardInterrupt(), 130),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x),
)
def test_each_class_of_failure_has_one_exit_status(error, status, monkeypatch, capsys):
    from terra import tensorflow_setup

    monkeypatch.setattr(tensorflow_setup, "import_tensorflow_quietly", lambda: None)
    assert _fails_with(error).main([]) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    if status == 1 and isinstance(error, OSError):  # a full or read-only disk names the file and what to do
        assert err.startswith(f"error: cannot write {error.filename}: ") and "rerun the same command" in err


def test_a_write_cut_short_by_a_full_disk_names_the_file_it_was_writing(tmp_path, monkeypatch):
    """A new MODEL_DIR's first files on a full disk: the OSError of a write names no file; the
    command's one line must (files.write_atomically names the file it writes)."""
    from etils import epath

    from terra import files

    def full(self, data):
        raise OSError(28, "No space left on device")  # as a write() that fails part-way raises it

    monkeypatch.setattr(epath.Path, "write_bytes", full)
    target = tmp_path / "run" / "vocabulary" / "sentencepiece.model"
    target.parent.mkdir(parents=True)
    with pytest.raises(OSError) as error:
        files.write_atomically(str(target), b"model")
    assert (error.value.errno, error.value.filename) == (28, str(target)) and not list(target.parent.iterdir())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _fails_with(error.value).main([]) == 1
    assert err.getvalue().startswith(f"error: cannot write {target}: no space left on the device.")


def test_other_os_errors_are_not_mistaken_for_a_full_disk():
    assert errors.storage_problem(OSError(2, "No such file or directory")) is None
    assert errors.storage_problem(ValueError("bad")) is None
    try:  # the words of an error raised from another (TensorFlow's, TensorStore's carry no errno)
        try:
            raise RuntimeError("SaveV2: /runs/r/part-0.tempstate; No space left on device")
        except RuntimeError as inner:
            raise ValueError("saving the iterator failed") from inner
    except ValueError as outer:
        assert errors.storage_problem(outer) == "no space left on the device"


def test_the_exit_statuses_documented_are_the_ones_the_commands_return():
    text = open(os.path.join(REPO_ROOT, "docs", "commands.md"), encoding="utf-8").read()
    table = text.split("## Exit status", 1)[1]
    documented = {int(line.split("|")[1]) for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()}
    assert documented == {0, app.EXIT_USAGE, app.EXIT_FAILED, app.EXIT_INTERRUPTED}


@pytest.mark.slow
def test_a_missing_vocabulary_file_is_one_line_naming_it_before_model_dir_is_written(tmp_path, capsys):
    # The README's own pretraining line with a vocabulary path that is not there.
    c4 = tmp_path / "c4"
    c4.mkdir()
    (c4 / "c4-train.00000-of-00001.json").write_text('{"text": "a line of text", "url": "u"}\n')
    missing, model_dir = tmp_path / "vocab" / "c4-32k.model", tmp_path / "run"
    argv = [
        "--gin_file=experiments/pretrain_c4_dense_800m.gin",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--c4_json={c4}",
        f"--vocabulary={missing}",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: SentencePiece model not found: '{missing}'") and err.count("\n") == 1, err
    assert not model_dir.exists()


def test_c4_validation_files_kept_elsewhere_are_named_by_a_flag(tmp_path):
    from terra.cli import flag_groups

    flag_values = flags.FlagValues()
    flag_groups.define_data_flags(flag_values)
    flag_values(["terra-train", f"--c4_json={tmp_path / 'train'}", f"--c4_validation_json={tmp_path / 'val'}"])
    assert flag_groups.data_bindings(flag_values) == [
        f"terra.data.c4_source.json_path = {str(tmp_path / 'train')!r}",
        f"terra.data.c4_source.validation_json_path = {str(tmp_path / 'val')!r}",
    ]


@pytest.mark.slow
def test_a_run_reports_every_problem_of_its_config_and_data_in_one_error(tmp_path, capsys):
    # Pretraining on a user's own C4 folder at tiny size, three mistakes at once: the vocabulary
    # (4,100 ids) beyond vocab_size 512, the features beyond max_len, no validation files.
    c4 = tmp_path / "c4"
    c4.mkdir()
    (c4 / "c4-train.00000-of-00001.json").write_text('{"text": "a line of text", "url": "u"}\n')
    model_dir = tmp_path / "run"
    argv = [
        "--gin_file=experiments/pretrain_c4_dense_800m.gin",
        "--gin_file=sizes/tiny.gin",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--c4_json={c4}",
        "--gin.TransformerConfig.max_len=64",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 problems, each to fix before a run: (1) the task's 'inputs' vocabulary has "), err
    assert "(2) feature lengths" in err and "(3) " in err and "--c4_validation_json" in err and err.count("\n") == 1
    assert not model_dir.exists()


def test_tensorflows_cpp_log_is_off_in_the_api_unless_the_user_sets_its_level(monkeypatch):
    from terra import tensorflow_setup

    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    tensorflow_setup.quiet_tensorflow_logging()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    tensorflow_setup.quiet_tensorflow_logging()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    # The API (a notebook's way in) calls it before any import that can load TensorFlow.
    body = ast.parse(open(os.path.join(REPO_ROOT, "terra", "api.py"), encoding="utf-8").read()).body
    lines = [ast.unparse(node) for node in body]
    quieted = lines.index("quiet_tensorflow_logging()")
    heavy = ("jax", "tensorflow ", "tensorflow\n", "terra.data", "seqio", "flax", "terra.training")
    assert not any(h in line + "\n" for line in lines[:quieted] for h in heavy)
    # The API reaches the data layer (which loads TensorFlow) only through its registration, which
    # quiets TensorFlow first, in a notebook as in a command.
    (tasks,) = [node for node in body if isinstance(node, ast.FunctionDef) and node.name == "_tasks"]
    calls = [ast.unparse(node) for node in tasks.body]
    assert calls.index("parsing.register_terra_configurables(data_layer=True)") < calls.index(
        "from terra.data import tasks"
    )
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.setattr(tensorflow_setup, "_COMMAND_PROCESS", False)
    tensorflow_setup.before_data_layer()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"


def test_the_stored_gin_registry_is_the_live_one():
    from terra.gin_config import registration, registry_file

    assert registry_file.stored_registry() == registration.live_registry(), "run make gin-registry"


@pytest.mark.parametrize(
    "binding, message",
    [
        (
            "TransformerConfig.d_modle = 64",
            "--gin.TransformerConfig.d_modle=64: TransformerConfig has no parameter 'd_modle'. Did you mean 'd_model'? "
            "It takes: attention_dropout, cache_dtype, d_ff, d_model,",
        ),
        (
            "terra.training.CheckpointSettings.evrey = 3",
            "--gin.terra.training.CheckpointSettings.evrey=3: terra.training.CheckpointSettings has no parameter "
            "'evrey'. Did you mean 'every'?",
        ),
        (
            "MODEL/TransformerConfg.d_model = 64",
            "--gin.MODEL/TransformerConfg.d_model=64: terra has no configurable named TransformerConfg. "
            "Did you mean TransformerConfig?",
        ),
        (
            "TransformerConfig.d_model = " + "9" * 5000,
            "--gin.TransformerConfig.d_model: an integer of 5,000 digits is more than gin reads",
        ),
    ],
)
def test_an_unknown_parameter_or_configurable_is_reported_before_tensorflow_loads(
    binding, message, no_tensorflow, capsys
):
    assert train.main([QUICKSTART, override_checks.as_flag(binding)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_known_parameters_and_configurables_taking_any_keyword_pass():
    known = ["TransformerConfig.d_model = 64", "Trainer.steps = 3", "MODEL/SparseFeedForward.ff_sparsity = 8"]
    override_checks.check_overrides(known, None)


def test_a_syntax_error_in_a_gin_file_is_reported_before_tensorflow_loads(tmp_path, no_tensorflow, capsys):
    bad = tmp_path / "mine.gin"
    bad.write_text("include 'experiments/quickstart.gin'\nTRAIN_STEPS = = 3\n")
    assert train.main([f"--gin_file={bad}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: Invalid gin configuration (file {bad}):") and "line 2" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "command, argv, message",
    [
        (evaluate, [], "error: name the run: --checkpoint MODEL_DIR, or --gin_file=EXPERIMENT"),
        (train, [QUICKSTART], "error: MODEL_DIR must be set: experiments/quickstart.gin leaves it %gin.REQUIRED"),
        (train, ["--gin_file={loop}"], "error: Invalid gin configuration (file {loop}): its includes form a loop"),
        (vocab, ["--input={tmp}/absent.txt", "--out={tmp}/v.model"], "error: input file not found: {tmp}/absent.txt"),
        (vocab, ["--out={tmp}/v.model"], "error: give exactly one text source: --input FILE, --embedded or --task"),
        (vocab, ["--input={tmp}", "--out={tmp}/v.model"], "error: input is not a regular file: {tmp}"),
    ],
    ids=[
        "evaluate with no run",
        "train without MODEL_DIR",
        "an include loop",
        "vocab input missing",
        "vocab no text",
        "vocab input a folder",
    ],
)
def test_flag_and_config_errors_are_reported_before_tensorflow_loads(
    tmp_path, no_tensorflow, capsys, command, argv, message
):
    loop = tmp_path / "loop.gin"
    loop.write_text(f"include '{loop}'\n")
    assert command.main([a.format(loop=loop, tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(loop=loop, tmp=tmp_path)) and err.count("\n") == 1, err
    assert not (tmp_path / "v.model").exists()
