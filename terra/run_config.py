"""A run's ``config.gin`` read as data: what terra writes into a run, and nothing else.

``terra.load``, ``terra-evaluate --checkpoint`` and ``terra-summarize --checkpoint`` open runs that
others made. Parsed as gin parses an experiment, a config imports every module it names, reads
every file it includes and calls the configurable behind every ``@name()`` it meets while the
model is built, and some of terra's own configurables write files (vocabulary training, the
embedded corpus, evaluation output) or read a path of the config's choosing. So a run's config is
read once, as a regular file of at most :data:`MAX_CONFIG_BYTES`, its statements are checked
against an allow-list without importing or calling anything, and that same text (not the file
again) is what gin parses:

- ``import`` of terra's configurable packages only (:data:`IMPORTABLE`); no ``include`` and no
  block (terra writes neither);
- bindings only to terra's configurables, each of which has a role in :data:`ROLES`: the
  configurables a run's config holds may be bound; those that write files or read a path of
  their own (``REFUSED``) may not be named at all;
- values that are data: ``None``, bools, numbers, strings, and lists, tuples and dicts of them
  (dict keys strings or numbers), ``%`` macros, and ``@`` references only to configurables that
  build something without side effects (``REFERABLE``: layers, models, optimizers, schedules,
  settings, feature converters).

Anything else is one :class:`~terra.errors.ConfigError` naming the file, the line and the
selector; nothing has been imported, called or written when it is raised. The roles cover the
registry exactly (``terra/gin_config/registry.json``; a test keeps them in step), so a configurable
added later is refused here until it is given a role.
"""

import dataclasses
from typing import Any, Dict, List, Sequence

from gin import config_parser

from terra import files
from terra.errors import ConfigError
from terra.gin_config import reading, registry_file

CONFIG_FILE = "config.gin"
# A run's config.gin is a few to tens of kilobytes (an 800M Terraformer's: about 10 KB).
MAX_CONFIG_BYTES = 1 << 20
# Nesting of lists and dicts in one value; terra writes at most two levels.
MAX_VALUE_DEPTH = 16

REFERABLE = "referable"  # may be bound and referenced (@name or @name()): builds, writes nothing
BINDABLE = "bindable"  # may be bound; never referenced (terra calls it itself, where it reads data)
REFUSED = "refused"  # writes files or reads a path of its own: never named in a run's config

_REFERABLE_PACKAGES = ("terra.layers.", "terra.models.")
_REFERABLE = {
    "terra.training.adafactor",
    "terra.training.adamw",
    "terra.training.sgd",
    "terra.training.build_optimizer",
    "terra.training.constant_schedule",
    "terra.training.rsqrt_schedule",
    "terra.training.warmup_cosine_schedule",
    "terra.training.ParallelSettings",
    "terra.training.CheckpointSettings",
    "terra.training.EvaluationSettings",
    "terra.training.LoggingSettings",
    "terra.parallel.make_mesh",
    "terra.data.encoder_decoder_converter",
    "terra.data.prefix_lm_converter",
    "terra.data.length_concat_converter",
    "terra.data.language_model_converter",
    "terra.data.byte_vocabulary",
    "terra.data.digit_vocabulary",
    "terra.data.synthetic_vocabulary",
    "terra.evaluation.RougeEvaluation",
}
# Why each refused configurable is refused: it is named in the error.
_REFUSED = {
    "terra.data.train_sentencepiece": "trains a SentencePiece model and writes it at a path of its own",
    "terra.data.embedded_vocabulary": "trains and caches a vocabulary in a folder of its own",
    "terra.data.build_corpus": "builds the embedded corpus in a folder of its own",
    "terra.data.corpus_texts": "builds the embedded corpus in a folder of its own",
    "terra.data.lm_source": "builds the embedded corpus in a folder of its own",
    "terra.data.summarization_source": "builds the embedded corpus in a folder of its own",
    "terra.data.sentencepiece_vocabulary": "reads a SentencePiece model at a path of its own",
    "terra.evaluation.evaluate": "writes evaluation results to a folder of its own",
}
# Python packages a run's config may import: those that define terra's configurables.
IMPORTABLE = ("terra.data", "terra.evaluation", "terra.layers", "terra.models", "terra.parallel", "terra.training")


def role(selector: str) -> str:
    """The role of a configurable of terra's registry (its full selector)."""
    if selector in _REFUSED:
        return REFUSED
    if selector in _REFERABLE or selector.startswith(_REFERABLE_PACKAGES):
        return REFERABLE
    return BINDABLE


def roles() -> Dict[str, str]:
    """``{selector: role}`` of every configurable in terra's stored registry."""
    return {selector: role(selector) for selector in registry_file.stored_registry()}


@dataclasses.dataclass(frozen=True)
class RunConfig(reading.GinText):
    """A run's ``config.gin``, read once and checked: ``path`` (where it was read), ``text`` (what
    gin parses) and ``statements`` (gin's reading of it, nothing resolved)."""

    statements: Sequence[Any] = ()

    def bound_literal(self, selector: str, parameter: str, default: Any = None) -> Any:
        """The last value the config binds to ``selector.parameter`` (a full selector; bindings
        written with a shorter name or a scope count), or ``default``."""
        value = default
        for statement in self.statements:
            if (
                isinstance(statement, config_parser.BindingStatement)
                and statement.arg_name == parameter
                and registry_file.full_selector(statement.selector) == selector
            ):
                value = statement.value
        return value


def read_run_config(path: str) -> RunConfig:
    """The run config at ``path`` (a local path or URL), read as a regular file of at most
    :data:`MAX_CONFIG_BYTES` and checked statement by statement (the module's docstring).

    Raises:
      ConfigError: the file is not a regular file, is too large, is not UTF-8 text gin can read,
        or holds anything terra does not write into a run (the file, line and selector named).
    """
    what = f"the run's {CONFIG_FILE}"
    data = files.read_regular_file(path, MAX_CONFIG_BYTES, ConfigError, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); a run's {CONFIG_FILE} is gin text.") from None
    return RunConfig(path=path, text=text, statements=check_text(text, path))


def check_text(text: str, path: str) -> List[Any]:
    """gin's statements of a run config's ``text`` (read from ``path``), each checked; a
    :class:`ConfigError` at the first that terra would not write into a run."""
    try:
        statements = reading.read_statements(text)
    except SyntaxError as error:
        line = f", line {error.lineno}" if error.lineno else ""
        reason = " ".join(str(error.msg or error).split())[:200]
        raise ConfigError(
            f"{path}{line}: gin cannot read it ({reason}); a run's {CONFIG_FILE} is the gin text terra wrote. It "
            "was not loaded."
        ) from None
    except (ValueError, RecursionError, MemoryError) as error:  # a literal Python will not build
        reason = "nested too deeply" if isinstance(error, RecursionError) else type(error).__name__
        raise ConfigError(
            f"{path} holds a value gin cannot read ({reason}); a run's {CONFIG_FILE} holds numbers, strings, "
            "lists and dicts that terra wrote. It was not loaded."
        ) from None
    for statement in statements:
        _check_statement(statement, path)
    return statements


class _Refusal(Exception):
    """One reason a statement is not what terra writes into a run."""


def _check_statement(statement, path: str) -> None:
    line = getattr(getattr(statement, "location", None), "line_num", None)
    where = f"{path}, line {line}" if line else path
    try:
        if isinstance(statement, config_parser.ImportStatement):
            _check_import(statement)
            return
        if isinstance(statement, config_parser.IncludeStatement):
            raise _Refusal(f"includes {statement.filename} (terra writes a run's config whole, with no include)")
        if not isinstance(statement, config_parser.BindingStatement):
            raise _Refusal(f"holds a {type(statement).__name__} (terra writes bindings and imports only)")
        name = statement.selector + (f".{statement.arg_name}" if statement.arg_name else "")
        if statement.arg_name:
            _check_bound_selector(statement.selector)
        _check_value(statement.value, name, 0)
    except _Refusal as refusal:
        raise ConfigError(
            f"{where}: {refusal}. A run's {CONFIG_FILE} may hold only what terra writes into a run, so it was not "
            "loaded and nothing it names was imported, called or written. Name an experiment you trust with "
            "--gin_file instead."
        ) from None


def _check_import(statement) -> None:
    module = statement.module
    if module != "terra" and not any(module == package or module.startswith(package + ".") for package in IMPORTABLE):
        raise _Refusal(f"imports {module} (a run's config imports only terra's configurable packages)")


def _check_bound_selector(selector: str) -> None:
    full = registry_file.full_selector(selector)
    if full is None:
        raise _Refusal(f"binds {selector}, which is not one of terra's configurables")
    if role(full) == REFUSED:
        raise _Refusal(f"binds {full}, which {_REFUSED[full]}")


def _check_value(value, name: str, depth: int) -> None:
    if depth > MAX_VALUE_DEPTH:
        raise _Refusal(f"{name} nests its value more than {MAX_VALUE_DEPTH} deep")
    if value is None or isinstance(value, (bool, int, float, str, reading.MacroUse)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_value(item, name, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise _Refusal(f"{name} has a dict key that is not a string or an integer")
            _check_value(item, name, depth + 1)
        return
    if isinstance(value, reading.Reference):
        full = registry_file.full_selector(value.name)
        if full is None:
            raise _Refusal(f"{name} refers to @{value.name}, which is not one of terra's configurables")
        if role(full) != REFERABLE:
            why = _REFUSED.get(full, "is called by terra itself where it reads data, never from a config")
            raise _Refusal(f"{name} refers to @{value.name} ({full}), which {why}")
        return
    raise _Refusal(f"{name} holds a {type(value).__name__}, not a value terra writes")
