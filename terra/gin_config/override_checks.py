"""The ``--gin`` overrides of a command line, checked before anything heavy is imported.

Reading gin files is pure Python: gin's own parser reads the files a command will parse
(following their includes) without importing the modules they name, in milliseconds. That is
enough to report, before TensorFlow, seqio, JAX or a model load:

- a gin file gin cannot parse (the file, line and what gin expected);
- a value gin cannot parse, with a hint to quote it when it looks like a word or a path
  (``--gin.MODEL_DIR=runs/x``);
- a macro no config declares or uses (``--gin.TRAIN_STEPZ=10``): gin would accept it and the
  run would silently keep the default; the closest macro and the full list are named;
- a macro override whose type is not the type of the value the configs declare
  (``--gin.TRAIN_STEPS="'ten'"`` where ``TRAIN_STEPS = 300``).

- a parameter of a configurable that does not exist (``--gin.TransformerConfig.d_modle=64``) or
  a configurable terra does not have, with the closest names, from the stored registry of terra's
  configurables (:mod:`terra.gin_config.registry_file`).

The types of parameter values (``--gin.TransformerConfig.d_model="'64'"``) are checked against
their signatures once the modules are imported (``terra.gin_config.parsing.check_binding_types``).
"""

import dataclasses
import difflib
import os
import re
from typing import Dict, List, Optional, Sequence, Set

from gin import config_parser

import terra
from terra.gin_config import parsing, registry_file
from terra.gin_config.parsing import GinConfigError

# A value that fails to parse and has none of these characters is meant as a string.
_NOT_A_WORD = re.compile(r"""['"\[\]{}()@%,=]""")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(terra.__file__)))


class _Unreadable(Exception):
    """A config this reader cannot follow (an include it cannot find, a syntax error): the
    checks that need the configs are skipped and the full parse reports the problem."""


@dataclasses.dataclass
class Macros:
    """The macros a set of gin files declares (last declaration wins, as in gin), and those
    they use (``%NAME``) without declaring: an override of either is meaningful."""

    files: Sequence[str]
    declared: Dict[str, tuple] = dataclasses.field(default_factory=dict)  # name -> (value, path)
    used: Set[str] = dataclasses.field(default_factory=set)

    @property
    def names(self) -> List[str]:
        return sorted(set(self.declared) | {n for n in self.used if "." not in n})  # not gin.REQUIRED


def check_overrides(
    bindings: Sequence[str],
    gin_files: Optional[Sequence[str]],
    search_paths: Sequence[str] = (),
    complete: bool = False,
) -> None:
    """Raises ``GinConfigError`` for the first binding (``NAME = VALUE``, as ``--gin.NAME=VALUE``
    becomes) that cannot parse, sets an unknown macro or gives a macro a value of the wrong
    type, and for files whose includes form a loop. ``gin_files`` are the files the command
    parses before the bindings; without them (``None`` or empty: not known before the command
    runs) only the values are checked. ``complete``: the files and bindings are the whole config
    (``terra-train``), so a macro they leave ``%gin.REQUIRED`` is an error too."""
    parsed = [(binding, _parse(binding)) for binding in bindings]
    parameters = [(b, s) for b, statements in parsed for s in statements if s.arg_name]
    if parameters:
        registry = registry_file.stored_registry()
        for binding, statement in parameters:
            _check_parameter(binding, statement, registry)
    if not gin_files:
        return
    macros = declared_macros(gin_files, search_paths)  # a syntax error in a file is reported here
    overrides = [(b, s) for b, statements in parsed for s in statements if not s.arg_name and not s.scope]
    if macros is None:
        return
    for binding, statement in overrides:
        _check_macro(binding, statement, macros)
    if complete:
        _check_required(macros, {s.selector for _, s in overrides})


def _check_required(macros: Macros, overridden: Set[str]) -> None:
    """A macro the files leave ``%gin.REQUIRED`` and no ``--gin`` flag sets: gin would report it
    only when the config is locked, after the heavy imports."""
    missing = [
        name
        for name, (value, _) in macros.declared.items()
        if isinstance(value, parsing.MacroUse) and value.name == "gin.REQUIRED" and name not in overridden
    ]
    if missing:
        examples = " ".join(f"--gin.{name}=..." for name in missing)
        raise GinConfigError(
            f"{', '.join(missing)} must be set: {', '.join(macros.files)} "
            f"{'leaves' if len(macros.files) == 1 else 'leave'} {'them' if len(missing) > 1 else 'it'} "
            f"%gin.REQUIRED; give {examples} (MODEL_DIR is the run's folder, e.g. --gin.MODEL_DIR=\"'runs/x'\")."
        )


def _parse(binding: str) -> list:
    try:
        statements = parsing.read_statements(binding)
    except SyntaxError as e:
        raise GinConfigError(_unparsable(binding, e)) from None
    return [s for s in statements if isinstance(s, config_parser.BindingStatement)]


def as_flag(binding: str) -> str:
    """``--gin.NAME=VALUE`` for the binding ``NAME = VALUE``: the form the user typed."""
    name, _, value = binding.partition("=")
    return f"--gin.{name.strip()}={value.strip()}"


def _unparsable(binding: str, error: SyntaxError) -> str:
    name, _, value = (part.strip() for part in binding.partition("="))
    if value.lstrip("+-").isdigit():  # a number gin's reader (Python's) will not convert
        return (
            f"--gin.{name}: an integer of {len(value.lstrip('+-')):,d} digits is more than gin reads (Python converts "
            "integers of at most 4,300 digits); give a number the parameter can use."
        )
    if value and not _NOT_A_WORD.search(value):
        # gin reads values as Python literals: runs/x is the expression runs / x, not a path.
        reference = f" (or @{value} for a configurable)" if value.replace(".", "").isidentifier() else ""
        return (
            f"{as_flag(binding)}: gin values are Python literals; quote strings: --gin.{name}=\"'{value}'\"{reference}."
        )
    reason = (error.msg or str(error)).split("\n")[0].rstrip(".")
    return (
        f"{as_flag(binding)}: gin cannot parse this binding ({reason}). Values are Python literals: "
        "numbers, True/False/None, quoted strings, lists, dicts; @Name for a configurable, %NAME for a macro."
    )


def _check_macro(binding: str, statement, macros: Macros) -> None:
    name, value = statement.selector, statement.value
    if name not in macros.declared and name not in macros.used:
        raise GinConfigError(_unknown_macro(binding, name, macros))
    default, path = macros.declared.get(name, (None, None))
    expected = parsing.literal_type(default)
    if expected is not None and not parsing.fits(value, expected):
        kind, given = parsing.type_name(expected), parsing.type_name(value)
        raise GinConfigError(
            f"{as_flag(binding)} is {given}, but {name} is {kind} in {_shown(path)} (default {default!r}): "
            f"give {kind}, e.g. {_example(name, default)}."
        )


def _check_parameter(binding: str, statement, registry) -> None:
    """An override of a configurable's parameter names one terra has, and a parameter it takes."""
    selector, name = statement.selector, statement.arg_name
    if selector.startswith("gin."):
        return
    matches = [full for full in registry if full == selector or full.endswith("." + selector)]
    if not matches:
        short = {full.rsplit(".", 1)[-1]: full for full in registry}
        close = difflib.get_close_matches(selector.rsplit(".", 1)[-1], list(short), n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise GinConfigError(
            f"{as_flag(binding)}: terra has no configurable named {selector}.{hint} Every configurable and its "
            "parameters: terra/gin_config/registry.json."
        )
    known = registry[matches[0]] if len(matches) == 1 else None  # ambiguous: gin itself reports it
    if known is None or name in known:
        return
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise GinConfigError(
        f"{as_flag(binding)}: {selector} has no parameter {name!r}.{hint} It takes: {', '.join(known)}."
    )


def _unknown_macro(binding: str, name: str, macros: Macros) -> str:
    known = macros.names
    by_upper = {n.upper(): n for n in known}
    close = difflib.get_close_matches(name.upper(), list(by_upper), n=1)
    hint = f" Did you mean {by_upper[close[0]]}?" if close else ""
    if not name.isupper():
        hint += " A configurable's parameter is set as --gin.Configurable.param=VALUE."
    return (
        f"{as_flag(binding)} sets a macro no config declares.{hint} Macros declared by "
        f"{', '.join(macros.files)}: {', '.join(known) or 'none'}."
    )


def _example(name: str, default) -> str:
    return (
        f'--gin.{name}="{default!r}"' if isinstance(default, (str, dict, list, tuple)) else f"--gin.{name}={default!r}"
    )


def _shown(path: str) -> str:
    """A config's path as the user knows it: terra/configs/... for a shipped one."""
    shown = parsing.shown_name(path)
    if shown == path and path.startswith(os.getcwd() + os.sep):
        return os.path.relpath(path, os.getcwd())
    return shown


# --- reading the configs' macros ------------------------------------------------------------------


def declared_macros(gin_files: Sequence[str], search_paths: Sequence[str] = ()) -> Optional[Macros]:
    """The macros ``gin_files`` declare and use, following includes as gin does; ``None`` when
    a file cannot be followed (the full parse then reports it). A ``gin_files`` name that does
    not exist raises the same ``GinConfigError`` as the full parse."""
    macros = Macros(files=list(gin_files))
    paths = [parsing.resolve_gin_file(f, search_paths) for f in gin_files]
    try:
        for path in paths:
            _read(path, search_paths, macros, ())
    except _Unreadable:
        return None
    return macros


def _read(path: str, search_paths: Sequence[str], macros: Macros, including: tuple) -> None:
    if path in including:  # gin would recurse until Python's stack runs out
        raise parsing.include_loop_error(including[0])
    if len(including) > 32:
        raise _Unreadable(path)
    try:
        with open(path, encoding="utf-8") as f:
            statements = parsing.read_statements(f)
    except SyntaxError as error:  # the message the full parse would give, before the heavy imports
        raise parsing.explain_gin_error(error, f"file {path}") from None
    except (OSError, UnicodeDecodeError):
        raise _Unreadable(path) from None
    for statement in statements:
        if isinstance(statement, config_parser.IncludeStatement):
            _read(_include(statement.filename, search_paths), search_paths, macros, (*including, path))
        elif isinstance(statement, config_parser.BindingStatement):
            if not statement.arg_name:
                name = f"{statement.scope}/{statement.selector}" if statement.scope else statement.selector
                macros.declared[name] = (statement.value, path)
            macros.used.update(_macro_uses(statement.value))


def _include(name: str, search_paths: Sequence[str]) -> str:
    """Where gin finds an include: the working directory, the search paths and terra's configs,
    by name (``models/tiny.gin``) or package path (``terra/configs/models/tiny.gin``), else
    another package's resource."""
    try:
        return parsing.resolve_gin_file(name, search_paths)
    except GinConfigError:
        pass
    candidate = os.path.join(_PACKAGE_PARENT, name)  # another installed package's resource
    if os.path.isfile(candidate):
        return candidate
    raise _Unreadable(name)


def _macro_uses(value) -> Set[str]:
    if isinstance(value, parsing.MacroUse):
        return {value.name}
    if isinstance(value, dict):
        return set().union(*(_macro_uses(v) for v in [*value.keys(), *value.values()]))
    if isinstance(value, (list, tuple)):
        return set().union(*(_macro_uses(v) for v in value))
    return set()
