"""Parsing gin files and bindings, and turning gin's errors into messages that name the fix.

Files are parsed in order, then the bindings (later wins). A relative file name is looked up in
the working directory, then in the search paths a caller adds, then in the configs shipped in
the package (``terra/configs``), so ``models/tiny.gin`` works from any directory. The shipped
files include each other by their package path (``include 'terra/configs/runs/train.gin'``),
which gin resolves as a package resource wherever terra is installed. Errors are raised as
``GinConfigError`` with the offending file or binding and, for a misspelled name, the closest
valid names. Only gin's public API is used.
"""

import contextlib
import difflib
import inspect
import logging
import os
import re
import sys
from typing import Iterable, List, Sequence

import gin

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Where a gin file's ``include 'models/tiny.gin'`` finds the shipped configs.
CONFIG_FOLDERS = ("experiments", "models", "runs", "sizes", "tasks")

_UNKNOWN_PARAM = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching (?:reference )?'@?([\w.]+)'")
_SEARCH_PATHS_ADDED = set()  # gin's search path list only grows; add each path once per process


class GinConfigError(ValueError):
    """A gin file or binding that cannot be applied; the message says what to change."""


def register_terra_configurables() -> None:
    """Import every module whose classes gin files refer to (registration is an import side
    effect), so nothing registers after the config is locked."""
    from terra import configurables

    configurables.import_all()


def shipped_configs(folder: str) -> List[str]:
    """The shipped gin files of one of :data:`CONFIG_FOLDERS`, as ``folder/name.gin``."""
    path = os.path.join(CONFIGS_DIR, folder)
    names = sorted(n for n in os.listdir(path) if n.endswith(".gin")) if os.path.isdir(path) else []
    return [f"{folder}/{n}" for n in names]


def resolve_gin_file(path: str, search_paths: Sequence[str] = ()) -> str:
    """The file ``path`` names: as given (absolute, or relative to the working directory), else
    under each of ``search_paths``, else among the shipped configs."""
    candidates = [path] + [os.path.join(p, path) for p in (*search_paths, CONFIGS_DIR)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    where = ", ".join(["the working directory", *search_paths, CONFIGS_DIR])
    models = ", ".join(n.split("/", 1)[1] for n in shipped_configs("models")) or "none found"
    raise GinConfigError(
        f"Gin file {path!r} not found (looked in {where}). Shipped model configs (models/...): {models}; "
        "experiments: --gin_file=experiments/NAME.gin."
    )


def _configurable_names() -> List[str]:
    """Short names of terra's gin configurables, for suggestions: every public class or function
    of a loaded terra module that gin resolves (gin has no public listing of its registry)."""
    names = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("terra.") or module is None:
            continue
        for attr, value in vars(module).items():
            if attr.startswith("_") or attr in names or not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            try:
                gin.get_configurable(attr)
            except ValueError:
                continue
            names.add(attr)
    return sorted(names)


def _parameter_names(selector: str) -> List[str]:
    try:
        fn = gin.get_configurable(selector)
        return list(inspect.signature(fn).parameters)
    except (ValueError, TypeError):
        return []


def explain_gin_error(error: Exception, where: str) -> GinConfigError:
    """Turns a gin parse or call error into a message that names the fix."""
    message = str(error).strip()
    hint = ""
    match = _UNKNOWN_PARAM.search(message)
    if match:
        names = _parameter_names(match.group(1))
        close = difflib.get_close_matches(match.group(2), names, n=3)
        if close:
            hint = f"Did you mean {' or '.join(repr(c) for c in close)}? "
        if names:
            hint += f"Parameters of {match.group(1)}: {', '.join(n for n in names if n != 'self')}."
    match = _UNKNOWN_CONFIGURABLE.search(message)
    if match:
        close = difflib.get_close_matches(match.group(1).split(".")[-1], _configurable_names(), n=3)
        if close:
            hint = f"Did you mean {' or '.join(repr(c) for c in close)}?"
    text = f"Invalid gin configuration ({where}): {message}"
    return GinConfigError(text + (f"\n  {hint}" if hint else ""))


def _include_error(error: TypeError, where: str) -> GinConfigError:
    """gin resolves an include such as ``'models/tiny.gin'`` as a file under each search path
    and also as a resource of a Python package ``models``; a folder of that name in the working
    directory (a namespace package when the working directory is on ``sys.path``) makes gin's
    package lookup fail with a TypeError instead of moving on."""
    return GinConfigError(
        f"Invalid gin configuration ({where}): gin could not resolve an include ({error}). A folder in the "
        f"working directory named like a config folder ({', '.join(CONFIG_FOLDERS)}) hides the shipped configs "
        "from gin's package lookup: include shipped files by their package path, e.g. "
        "include 'terra/configs/models/dense_800m.gin', or run from another directory."
    )


def _explain_parse_error(error: Exception, where: str) -> GinConfigError:
    # gin's package lookup of a namespace package ends in os.path.dirname(None).
    if isinstance(error, TypeError) and "NoneType" in str(error):
        return _include_error(error, where)
    return explain_gin_error(error, where)


class _DropPathNotFound(logging.Filter):
    """gin probes every search path for an include and logs each miss as an error; the
    include either resolves on a later path or fails with an exception, so the log is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")


@contextlib.contextmanager
def _quiet_gin_path_probes():
    root = logging.getLogger()
    log_filter = _DropPathNotFound()
    root.addFilter(log_filter)
    try:
        yield
    finally:
        root.removeFilter(log_filter)


def add_search_paths(paths: Iterable[str]) -> None:
    """Make ``paths`` places where gin files' includes (and ``--gin_file`` names) are found."""
    for path in paths:
        path = os.path.abspath(os.path.expanduser(path))
        if path not in _SEARCH_PATHS_ADDED:
            gin.add_config_file_search_path(path)
            _SEARCH_PATHS_ADDED.add(path)


def parse_gin(
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
    *,
    finalize: bool = True,
    search_paths: Sequence[str] = (),
) -> None:
    """Parses files then bindings into the global gin config (clearing any earlier one)."""
    register_terra_configurables()
    gin.clear_config()
    add_search_paths([*search_paths, CONFIGS_DIR])
    files = [resolve_gin_file(f, search_paths) for f in gin_files]
    with _quiet_gin_path_probes():
        _parse_files_and_bindings(files, gin_bindings)
    if finalize:
        try:
            gin.finalize()
        except ValueError as e:  # e.g. a %gin.REQUIRED macro left unset
            raise explain_gin_error(e, "checking the parsed config") from None


def _parse_files_and_bindings(files: Sequence[str], gin_bindings: Sequence[str]) -> None:
    for path in files:
        try:
            gin.parse_config_file(path)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError, IOError) as e:
            raise _explain_parse_error(e, f"file {path}") from None
    for binding in gin_bindings:
        try:
            gin.parse_config(binding)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError) as e:
            raise _explain_parse_error(e, f"binding {binding!r}") from None


def build(selector_or_fn, where: str = "building the configured object"):
    """Calls a gin configurable (a selector such as ``'terra.training.Trainer'``, or
    the callable), turning configuration errors (bad values, missing REQUIRED bindings)
    into ``GinConfigError``."""
    fn = gin.get_configurable(selector_or_fn) if isinstance(selector_or_fn, str) else selector_or_fn
    try:
        return fn()
    except (ValueError, TypeError, RuntimeError) as e:
        raise explain_gin_error(e, where) from None


def build_model(where: str = "building the model"):
    """The model the parsed config's ``MODEL`` macro names (every ``models/*.gin``
    defines it), constructed, with configuration errors as ``GinConfigError``."""
    try:
        reference = gin.query_parameter("%MODEL")
    except ValueError:
        raise GinConfigError(
            "the gin config defines no MODEL; include a model config (e.g. --gin_file=models/tiny.gin)."
        ) from None
    # gin evaluates ``%MODEL`` inside the scope ``MODEL`` (a macro is a scoped configurable),
    # so a run's operative config records the model's bindings as ``MODEL/...``: build it in
    # that scope too (unscoped bindings still apply there).
    with gin.config_scope("MODEL"):
        return build(getattr(reference, "scoped_configurable_fn", lambda: reference), where)
