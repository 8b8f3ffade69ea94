"""The runner every terra command shares.

A :class:`Command` is a console command (``terra-train``), its ``python -m`` form
(``python -m terra.cli.train``), its help text, a function that defines its absl flags and a function that
runs it. Flags are defined on a fresh ``absl.flags.FlagValues`` at every call, so a command can be
called again in the same process (tests, notebooks) and define flags that depend on the
command line (a benchmark preset's ``--config.*`` fields). Everything heavy (JAX, TensorFlow,
seqio, the models) is imported by ``run`` after the flags are parsed, so ``--help``, ``--version``
and a mistyped flag answer at once; so do the ``--gin`` overrides, checked before those imports
against the gin files the command names (:mod:`terra.gin_config.override_checks`).

``main(argv)`` is the console entry point: it prints ``error: ...`` for bad input and returns
the exit status (2 for bad flags, configuration, data, checkpoints or inputs; 1 for a run that
cannot continue, a diverged loss or a full or read-only disk; 130 when interrupted).
``call(argv)`` runs the same command but lets terra's errors propagate, for callers that handle
them.
"""

import contextlib
import dataclasses
import difflib
import os
import sys
import textwrap
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from absl import flags

import terra
from terra import compilation_cache, errors, process_memory
from terra.gin_config import override_checks
from terra.gin_config.parsing import GinConfigError

HELP_FLAGS = ("--help", "-h", "--helpfull", "-help", "-?")
USAGE_ERRORS = (
    errors.UsageError,
    GinConfigError,
    errors.ConfigError,
    errors.DataNotFoundError,
    errors.CheckpointError,
    errors.InputError,
)
EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def error_message(error: BaseException) -> str:
    """The error's own message, without the ``In call to configurable ...`` lines gin appends
    to an exception raised inside a configurable (they name a function, not the user's input)."""
    lines = str(error).splitlines()
    return "\n".join(line for line in lines if not line.strip().startswith("In call to configurable")).strip()


def _leave(status: int) -> None:
    """End a failed command's process without Python's final garbage collection. A failed command
    has written what it keeps (checkpoints commit atomically; its error line is printed), while
    that collection can deadlock: destroying a ``tf.data`` iterator whose input functions wait for
    the interpreter lock (a damaged data file's error line, then a hang)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


DefineFlags = Callable[[flags.FlagValues, Sequence[str]], None]
Run = Callable[[flags.FlagValues, List[str]], Optional[int]]
GinFiles = Callable[[flags.FlagValues], Optional[Sequence[str]]]


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line. ``define_flags(flag_values, argv)`` defines the flags (``argv`` is the
    command line, for flags whose shape depends on it); ``run(flag_values, positional)`` runs
    the parsed command and returns its exit status (``None`` is 0). ``gin_files(flag_values)``
    names the gin files ``run`` will parse before the ``--gin`` bindings (``None``: not known
    before it runs), so that a binding to a macro they do not declare is reported before
    anything heavy is imported. ``reads_data``: the command imports the data layer itself
    (TensorFlow is then loaded quietly before it runs), or a function of the parsed flags that
    says whether this command line does; other commands load it only if their config names the
    data layer. A command with ``subcommands`` dispatches on its first argument
    instead."""

    name: str
    python_m: str
    doc: str
    define_flags: Optional[DefineFlags] = None
    run: Optional[Run] = None
    positional: str = ""  # e.g. "FILE..."; empty: the command takes no positional arguments
    gin_files: Optional[GinFiles] = None
    # imports the data layer itself (TensorFlow is loaded before it runs); or a function of the
    # parsed flags that says whether this command line does
    reads_data: Union[bool, Callable[[flags.FlagValues], bool]] = False
    complete_config: bool = False  # its gin files and --gin flags are the whole config (terra-train)
    subcommands: Mapping[str, "Command"] = dataclasses.field(default_factory=dict)

    @property
    def summary(self) -> str:
        """The help text's first sentence, on one line."""
        paragraph = " ".join(self.doc.strip().split("\n\n")[0].split())
        return paragraph.split(". ")[0].rstrip(".") + "."

    def usage(self) -> str:
        tail = (
            " SUBCOMMAND [flags]"
            if self.subcommands
            else " [flags]" + (f" {self.positional}" if self.positional else "")
        )
        return f"usage: {self.name}{tail}\n   or: {self.python_m}{tail}"

    def call(self, argv: Sequence[str]) -> int:
        """Parses ``argv`` (without the program name) and runs the command; terra's errors
        propagate. ``--help`` prints the help and returns 0."""
        argv = list(argv)
        if "--version" in argv:
            print(f"terra {terra.__version__}")
            return 0
        if self.subcommands:
            return self._dispatch(argv)
        wants_help = any(a in HELP_FLAGS for a in argv)
        argv = [a for a in argv if a not in HELP_FLAGS]
        flag_values = flags.FlagValues()
        argv = rewrite_gin_args(argv)
        with self._usage_errors(argv):
            if self.define_flags:
                self.define_flags(flag_values, argv)
            if wants_help:
                print(self.help_text(flag_values))
                return 0
            rest = flag_values([self.name, *argv])[1:]
        if rest and not self.positional:
            raise errors.UsageError(f"unexpected argument(s) {' '.join(rest)}; run '{self.name} --help' for its usage.")
        if self.positional and not rest:
            raise errors.UsageError(f"missing {self.positional}; run '{self.name} --help' for its usage.")
        self._check_gin_overrides(flag_values)
        # Large buffers back to the system when freed: a long document's prefill otherwise leaves
        # the process larger each time (terra/process_memory.py).
        process_memory.return_large_buffers_to_system()
        from terra import tensorflow_setup

        # TensorFlow loads quietly where the data layer is first needed; a command that reads data
        # directly loads it now, before anything imports terra.data.
        tensorflow_setup.quiet_imports_in_this_process()
        if self.reads_data(flag_values) if callable(self.reads_data) else self.reads_data:
            tensorflow_setup.import_tensorflow_quietly()
        return self.run(flag_values, rest) or 0

    @contextlib.contextmanager
    def _usage_errors(self, argv: Sequence[str]):
        """Bad flags, bad flag values and unknown ``--config`` fields as one ``UsageError``."""
        hint = f"\n  Run '{self.name} --help' for its flags."
        overrides_config = any(a.startswith("--config.") for a in argv)
        try:
            yield
        except flags.Error as e:
            raise errors.UsageError(f"{e}{hint}") from None
        except (KeyError, AttributeError) as e:
            if not overrides_config:  # not ml_collections rejecting an override: a real bug
                raise
            while e.args and isinstance(e.args[0], Exception):  # ml_collections wraps its KeyError
                e = e.args[0]
            field, _, suggestion = str(e.args[0] if e.args else e).partition("\n")
            raise errors.UsageError(f"unknown --config field {field}. {suggestion}{hint}") from None

    def _check_gin_overrides(self, flag_values: flags.FlagValues) -> None:
        """A mistyped ``--gin`` value or macro reported in a fraction of a second: the heavy
        imports (seconds: docs/commands.md, "How soon a command answers") come after."""
        if "gin_bindings" not in flag_values:
            return
        files = self.gin_files(flag_values) if self.gin_files else None
        search_paths = flag_values["gin_search_paths"].value if "gin_search_paths" in flag_values else []
        override_checks.check_overrides(flag_values.gin_bindings, files, search_paths, complete=self.complete_config)

    def _dispatch(self, argv: List[str]) -> int:
        """The subcommand is the first argument: ``terra-bench decode --preset tiny``."""
        if not argv or argv[0].startswith("-"):
            if any(a in HELP_FLAGS for a in argv):
                print(self.help_text(None))
                return 0
            raise errors.UsageError(
                f"name a subcommand first: {', '.join(self.subcommands)}. Run '{self.name} --help'."
            )
        name = argv[0]
        if name not in self.subcommands:
            close = difflib.get_close_matches(name, list(self.subcommands), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise errors.UsageError(f"unknown subcommand '{name}'.{hint} Choose from: {', '.join(self.subcommands)}.")
        return self.subcommands[name].call(argv[1:])

    def main(self, argv: Optional[Sequence[str]] = None) -> int:
        """The console entry point: runs the command and turns terra's errors into one line
        on standard error and an exit status. Run as a command (``argv`` None), a failed
        command ends its process at once (see :func:`_leave`). Run as a command, it first
        restarts under glibc's huge pages for large blocks where the machine has them
        (``terra/process_memory.py``: a long document's prefill otherwise spends seconds in page
        faults), and keeps its compiled programs for the next run (``terra/compilation_cache.py``)."""
        if argv is None:
            process_memory.restart_with_huge_pages()
            compilation_cache.use_for_command()
        status = self._status(argv)
        if argv is None and status != 0:
            _leave(status)
        return status

    def _status(self, argv: Optional[Sequence[str]]) -> int:
        try:
            return self.call(sys.argv[1:] if argv is None else argv)
        except USAGE_ERRORS as e:
            print(f"error: {error_message(e)}", file=sys.stderr)
            return EXIT_USAGE
        except errors.TrainingError as e:
            print(f"error: {error_message(e)}", file=sys.stderr)
            return EXIT_FAILED
        except OSError as e:  # a full or read-only disk under anything but a checkpoint
            problem = errors.storage_problem(e)
            if problem is None:
                raise
            print(
                f"error: cannot write {e.filename or 'a file'}: {problem}. Free space or choose a writable folder, "
                "then rerun the same command; what was saved before is intact.",
                file=sys.stderr,
            )
            return EXIT_FAILED
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    def help_text(self, flag_values: Optional[flags.FlagValues]) -> str:
        parts = [self.usage(), "", textwrap.dedent(self.doc).strip()]
        if self.subcommands:
            width = max(len(n) for n in self.subcommands)
            parts += ["", "subcommands (each has its own --help):"]
            parts += [
                textwrap.fill(f"  {n:<{width}}  {c.summary}", 100, subsequent_indent=" " * (width + 4))
                for n, c in self.subcommands.items()
            ]
        if flag_values is not None:
            parts += ["", "flags:", *describe_flags(flag_values)]
            for name in flag_values:
                if is_config_flag(flag_values[name]) and name == flag_values[name].name:
                    parts += ["", f"--{name}.FIELD=VALUE overrides a field; the fields and their defaults:"]
                    parts += describe_config(flag_values[name].value, prefix=f"--{name}.")
        parts += ["", "--help prints this text; --version prints terra's version."]
        return "\n".join(parts)


def command(name: str, module: str, doc: str, **kwargs) -> Command:
    """The command ``name`` (``terra-train``, or ``terra-bench decode`` for a subcommand) whose
    ``python -m`` form runs ``module`` (``terra.cli.train``)."""
    python_m = " ".join([f"python -m {module}", *name.split(" ")[1:]])
    return Command(name=name, python_m=python_m, doc=doc or "", **kwargs)


def group(name: str, module: str, doc: str, subcommands: Dict[str, Command]) -> Command:
    """A command whose first positional argument names one of ``subcommands``."""
    return command(name, module, doc, subcommands=subcommands)


# --- gin flags in the T5X form -------------------------------------------------------------------


def rewrite_gin_args(argv: Sequence[str]) -> List[str]:
    """``--gin.NAME=VALUE`` becomes ``--gin_bindings=NAME = VALUE`` (T5X's shorthand)."""
    out = []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin.") :].partition("=")
            if not sep or not name:
                raise errors.UsageError(
                    f"malformed flag {arg!r}; write --gin.NAME=VALUE, e.g. --gin.TransformerConfig.d_model=512."
                )
            arg = f"--gin_bindings={name} = {value}"
        out.append(arg)
    return out


# --- help ----------------------------------------------------------------------------------------


def is_config_flag(flag) -> bool:
    """Whether ``flag`` is an ``ml_collections`` config flag (``--config``)."""
    from ml_collections.config_flags.config_flags import is_config_flag as is_ml_collections_config_flag

    return is_ml_collections_config_flag(flag)


def describe_flags(flag_values: flags.FlagValues) -> List[str]:
    """One entry per flag: name, help and default (config-field overrides left out)."""
    lines = []
    for name in sorted(set(flag_values)):
        flag = flag_values[name]
        if name != flag.name or "." in name:
            continue
        if is_config_flag(flag):
            lines.append(f"  --{name}.FIELD=VALUE: {flag.help}")
            continue
        text = flag.help.split(";\n")[0] if isinstance(flag, flags.MultiFlag) else flag.help  # absl's repeat note
        kind = "repeatable" if isinstance(flag, flags.MultiFlag) else ""
        shown = repr(flag.default) if isinstance(flag.default, str) else flag.default
        default = "" if flag.default in (None, [], "") else f"default: {shown}"
        note = "; ".join(x for x in (kind, default) if x)
        lines.append(f"  --{name}: {text}" + (f" ({note})" if note else ""))
    return [textwrap.fill(line, 100, subsequent_indent="      ") for line in lines]


def describe_config(config, prefix: str = "--config.") -> List[str]:
    """``--config.FIELD=default`` for every field (nested fields dotted); a list of rows is
    shown by the rows' names (rows are not overridden from the command line)."""
    lines = []
    for key, value in config.items():
        if hasattr(value, "items") and not isinstance(value, dict):
            lines += describe_config(value, prefix=f"{prefix}{key}.")
        elif isinstance(value, (list, tuple)) and value and hasattr(value[0], "items"):
            names = "; ".join(str(row.get("name", i)) for i, row in enumerate(value))
            lines.append(f"  {prefix}{key}: {len(value)} rows ({names}), set by the preset")
        else:
            lines.append(f"  {prefix}{key}={value!r}" if isinstance(value, str) else f"  {prefix}{key}={value}")
    return lines
