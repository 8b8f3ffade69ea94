"""Command-line gin: repeated ``--gin_file`` and ``--gin.NAME=VALUE`` flags (the T5X form).

  python -m terra.train --gin_file=configs/models/tiny.gin --gin.TransformerConfig.d_model=64

Files are parsed in order, then the bindings (later wins). Relative file names are looked up
in the working directory, then in the repository's ``configs/`` folder, so
``--gin_file=models/tiny.gin`` also works. Errors are re-raised as ``GinConfigError`` with the
offending file or binding and, for a misspelled name, the closest valid names.
"""

import argparse
import contextlib
import difflib
import inspect
import logging
import os
import re
import sys
from typing import Callable, List, Optional, Sequence, Tuple

import gin

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

_UNKNOWN_PARAM = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching (?:reference )?'@?([\w.]+)'")


class GinConfigError(ValueError):
    """A gin file or binding that cannot be applied; the message says what to change."""


def register_terra_configurables() -> None:
    """Import every module whose classes gin files refer to (registration is an import side
    effect), so nothing registers after the config is locked."""
    from terra import configurables

    configurables.import_all()


def split_gin_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Separates ``--gin.NAME=VALUE`` flags (returned as gin binding strings) from the rest."""
    bindings, rest = [], []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin.") :].partition("=")
            if not sep or not name:
                raise GinConfigError(f"Malformed flag {arg!r}; write --gin.NAME=VALUE, e.g. --gin.TransformerConfig.d_model=512.")
            bindings.append(f"{name} = {value}")
        else:
            rest.append(arg)
    return bindings, rest


def resolve_gin_file(path: str) -> str:
    for candidate in (path, os.path.join(CONFIGS_DIR, path)):
        if os.path.isfile(candidate):
            return candidate
    raise GinConfigError(
        f"Gin file {path!r} not found (looked in the working directory and in {CONFIGS_DIR}). "
        f"Available model configs: {', '.join(sorted(os.listdir(os.path.join(CONFIGS_DIR, 'models'))))}."
    )


def _registered_names() -> List[str]:
    # gin has no public listing of configurables; fall back to no suggestions if that changes.
    registry = getattr(gin.config, "_REGISTRY", None)
    try:
        return sorted({selector.split(".")[-1] for selector, _ in registry.items()})
    except (AttributeError, TypeError):
        return []


def _parameter_names(selector: str) -> List[str]:
    try:
        fn = gin.get_configurable(selector)
        return list(inspect.signature(fn).parameters)
    except Exception:  # pylint: disable=broad-except
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
        close = difflib.get_close_matches(match.group(1).split(".")[-1], _registered_names(), n=3)
        if close:
            hint = f"Did you mean {' or '.join(repr(c) for c in close)}?"
    text = f"Invalid gin configuration ({where}): {message}"
    return GinConfigError(text + (f"\n  {hint}" if hint else ""))


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


def _tolerate_directories_named_like_config_folders() -> None:
    """gin also looks for an ``include 'runs/train.gin'`` as a file of a Python package ``runs``;
    a plain ``runs/`` directory in the working directory (where users put MODEL_DIRs) is a
    namespace package without a file, and gin's check then raises TypeError instead of moving
    on to the next search path. Treat that as "not found"."""
    from gin import config as gin_config
    from gin import resource_reader

    for i, (reader, exists) in enumerate(gin_config._FILE_READERS):
        if exists is resource_reader.system_path_file_exists:

            def safe_exists(path, _exists=exists):
                try:
                    return _exists(path)
                except TypeError:
                    return False

            gin_config._FILE_READERS[i] = (reader, safe_exists)


def parse_gin(gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (), *, finalize: bool = True) -> None:
    """Parses files then bindings into the global gin config (clearing any earlier one)."""
    register_terra_configurables()
    _tolerate_directories_named_like_config_folders()
    gin.clear_config()
    gin.add_config_file_search_path(CONFIGS_DIR)
    files = [resolve_gin_file(f) for f in gin_files]
    with _quiet_gin_path_probes():
        _parse_files_and_bindings(files, gin_bindings)
    if finalize:
        gin.finalize()


def _parse_files_and_bindings(files: Sequence[str], gin_bindings: Sequence[str]) -> None:
    for path in files:
        try:
            gin.parse_config_file(path)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError, IOError) as e:
            raise explain_gin_error(e, f"file {path}") from None
    for binding in gin_bindings:
        try:
            gin.parse_config(binding)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError) as e:
            raise explain_gin_error(e, f"binding {binding!r}") from None


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
    """The model the parsed config's ``MODEL`` macro names (every ``configs/models/*.gin``
    defines it), constructed, with configuration errors as ``GinConfigError``."""
    try:
        reference = gin.query_parameter("%MODEL")
    except ValueError:
        raise GinConfigError(
            "the gin config defines no MODEL; include a model config (e.g. --gin_file=models/tiny.gin).") from None
    # gin evaluates ``%MODEL`` inside the scope ``MODEL`` (a macro is a scoped configurable),
    # so a run's operative config records the model's bindings as ``MODEL/...``: build it in
    # that scope too (unscoped bindings still apply there).
    with gin.config_scope("MODEL"):
        return build(getattr(reference, "scoped_configurable_fn", lambda: reference), where)


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gin_file",
        action="append",
        default=[],
        help="Gin file to parse (repeatable; later files override earlier ones).",
    )
    parser.add_argument(
        "--gin_bindings",
        action="append",
        default=[],
        help="A gin binding 'NAME = VALUE' (repeatable); --gin.NAME=VALUE is the short form.",
    )


def parse_flags(
    parser: argparse.ArgumentParser,
    argv: Optional[Sequence[str]] = None,
    flag_bindings: Optional[Callable[[argparse.Namespace], List[str]]] = None,
):
    """Parses ``argv`` (``--gin.X=Y`` included) and the gin config; returns the argparse namespace.
    ``flag_bindings(args)`` turns convenience flags (e.g. ``--tfds_data_dir``) into bindings
    applied after the gin files and before the explicit ``--gin`` bindings."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bindings, rest = split_gin_args(argv)
    args = parser.parse_args(rest)
    from_flags = flag_bindings(args) if flag_bindings else []
    parse_gin(args.gin_file, from_flags + list(args.gin_bindings) + bindings)
    return args


def run_cli(main: Callable[[], int]) -> None:
    """Runs ``main`` and reports configuration errors as one clear message (exit status 2)."""
    from terra.errors import CheckpointError, ConfigError, DataNotFoundError, InputError, TrainingError  # local: import-light
    from terra.tensorflow_setup import import_tensorflow_quietly

    import_tensorflow_quietly()
    try:
        sys.exit(main() or 0)
    except (GinConfigError, ConfigError, DataNotFoundError, CheckpointError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
