"""Parsing gin files and bindings, and turning gin's errors into messages that name the fix.

Files are parsed in order, then the bindings (later wins). A relative file name is looked up in
the working directory, then in the search paths a caller adds, then in the shipped configs (the
package ``terra.configs``: the checkout's top-level ``configs/``, mapped there by setup.cfg's
``package_dir``; ``terra/configs/`` inside a wheel), so ``models/tiny.gin`` works from any
directory. The shipped files include each other by their package path
(``include 'terra/configs/runs/train.gin'``), which resolves to the shipped file wherever terra
is installed, and in a checkout put on ``sys.path`` without an install. Errors are raised as
``GinConfigError`` with the offending file or binding and, for a misspelled name, the closest
valid names; a literal of the wrong type for a configurable's parameter (``'64'`` for an
``int``) fails when the bindings are parsed, naming the binding, not later inside the library.
Only gin's public API is used (its parser, ``gin.config_parser``, reads texts without resolving
references, so a config can be read before the modules it names are imported).

What :func:`build_macro` builds is frozen to the config it was built under
(``terra/gin_config/frozen.py``).
"""

import contextlib
import importlib.abc
import importlib.util
import inspect
import logging
import os
import re
import sys
import tokenize
import types
import typing
from typing import Any, Iterable, List, Optional, Sequence

import gin
from gin import config_parser

from terra import files
from terra.gin_config import frozen
from terra.gin_config.reading import (
    GinConfigError,
    GinText,
    MacroUse,
    Reference,
    configurable_target,
    explain_gin_error,
    read_statements,
)


def _configs_dir() -> str:
    """The folder of the package ``terra.configs``; the checkout's ``configs/`` when the checkout
    is on ``sys.path`` without an install (no package maps ``terra.configs`` there)."""
    spec = importlib.util.find_spec("terra.configs")
    if spec is not None and spec.origin:
        return os.path.dirname(os.path.abspath(spec.origin))
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(checkout, "configs")


CONFIGS_DIR = _configs_dir()
# Where a gin file's ``include 'models/tiny.gin'`` finds the shipped configs.
CONFIG_FOLDERS = ("experiments", "models", "runs", "sizes", "tasks")
# The name the shipped files include each other by: the package path of ``terra.configs``.
SHIPPED_PREFIX = "terra/configs/"

# The parameters and macros that name local files or folders. A parse makes the relative ones
# absolute (against the working directory it ran in), so the operative config a run writes names
# the same files wherever the run is opened later (terra.training.run_directory).
PATH_PARAMETERS = (
    "terra.data.text_vocabulary.spm_path",
    "terra.data.c4_source.json_path",
    "terra.data.c4_source.validation_json_path",
    "terra.data.c4_source.tfds_data_dir",
    "terra.data.arxiv_source.tfds_data_dir",
    "terra.data.arxiv_source.cohan_path",
    "%MODEL_DIR",
    "%INIT_FROM",
)
_SEARCH_PATHS_ADDED = set()  # gin's search path list only grows; add each path once per process


# --- the types of gin values -------------------------------------------------------------------


_TYPE_NAMES = {
    bool: "a bool",
    int: "an int",
    float: "a float",
    str: "a str",
    list: "a list",
    tuple: "a tuple",
    dict: "a dict",
}


def type_name(value_or_type) -> str:
    """``'an int'`` for ``3`` or ``int``; ``'None'`` for ``None``."""
    if value_or_type is None:
        return "None"
    kind = value_or_type if isinstance(value_or_type, type) else type(value_or_type)
    return _TYPE_NAMES.get(kind, kind.__name__)


def literal_type(value) -> Optional[type]:
    """The type a literal default asks of an override; ``None`` (no constraint) for ``None``,
    references, macros and anything else gin cannot write as a literal."""
    return type(value) if type(value) in _TYPE_NAMES else None


def fits(value, expected: type) -> bool:
    """Whether ``value`` can stand where ``expected`` is asked. Lenient where Python is: an int
    is a float, a list and a tuple stand for each other, ``None`` and unresolved references
    and macros pass (their type is known only when the library runs)."""
    if value is None or isinstance(value, (Reference, MacroUse)):
        return True
    if isinstance(value, bool) or expected is bool:  # bool is an int subclass, but True is not a step count
        return isinstance(value, bool) and expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    if expected in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, expected)


_SIMPLE_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_OPTIONAL_NAME = re.compile(r"^(?:Optional\[(\w+)\]|(\w+)(?:\|None)?)$")


def _simple_annotation(annotation) -> Optional[type]:
    """``int`` for ``int``, ``Optional[int]``, ``int | None`` or their string forms (modules with
    ``from __future__ import annotations``); ``None`` for anything broader."""
    if isinstance(annotation, str):
        match = _OPTIONAL_NAME.match(annotation.replace(" ", ""))
        return _SIMPLE_TYPES.get(match.group(1) or match.group(2)) if match else None
    if annotation in _SIMPLE_TYPES.values():
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _simple_annotation(args[0]) if len(args) == 1 else None
    return None


def parameter_type(fn, name: str) -> Optional[type]:
    """The scalar type parameter ``name`` of ``fn`` takes, from its annotation or else its
    default; ``None`` when that is broader than one of bool, int, float and str."""
    try:
        parameter = inspect.signature(fn).parameters[name]
    except (ValueError, TypeError, KeyError):
        return None
    if parameter.annotation is not inspect.Parameter.empty:
        return _simple_annotation(parameter.annotation)
    default = parameter.default
    return type(default) if type(default) in _SIMPLE_TYPES.values() else None


def register_terra_configurables(data_layer: bool = True) -> None:
    """Register terra's configurables with gin (``terra/gin_config/registration.py``, the one place that
    does): the model core always, the data layer (seqio on TensorFlow) when ``data_layer``.
    Imported here, not at the top, so that reading and checking gin text imports neither JAX nor
    TensorFlow."""
    from terra.gin_config import registration  # importing it registers the model core

    if data_layer:
        registration.register_data_layer()


def names_data_layer(gin_files: Sequence[Any], gin_bindings: Sequence[str], search_paths: Sequence[str] = ()) -> bool:
    """Whether the files (following their includes) or bindings import, bind or refer to a
    configurable of the data layer (``terra.data``, ``terra.evaluation``; by the stored
    registry, nothing imported). A text this reader cannot follow counts as naming it: the full
    parse then has every name and reports the problem."""
    from terra.gin_config import registry_file

    def names(statement) -> bool:
        if isinstance(statement, config_parser.ImportStatement):
            return statement.module.startswith(_DATA_LAYER_PACKAGES)
        if isinstance(statement, config_parser.BindingStatement):
            selectors = [statement.selector] if statement.arg_name else []
            selectors += [r.name for r in _references(statement.value)]
            return any((registry_file.full_selector(s) or "").startswith(_DATA_LAYER_PACKAGES) for s in selectors)
        return False

    texts = _config_texts(gin_files, search_paths)
    if texts is None:
        return True
    return any(
        statement is None or names(statement)
        for text in [*texts, *gin_bindings]
        for statement in _statements_or_none(text)
    )


_DATA_LAYER_PACKAGES = ("terra.data", "terra.evaluation")


def _config_texts(gin_files: Sequence[Any], search_paths: Sequence[str] = ()) -> Optional[List[str]]:
    """The texts of ``gin_files`` and of every file they include, read without parsing them;
    ``None`` where one cannot be followed here (not found, a URL, unreadable)."""
    texts, seen, pending = [], set(), list(gin_files)
    while pending:
        item = pending.pop()
        if isinstance(item, GinText):
            texts.append(item.text)
            continue
        try:
            path = resolve_gin_file(item, [*search_paths, *sorted(_SEARCH_PATHS_ADDED)])
        except GinConfigError:
            return None
        if files.has_scheme(path):
            return None  # not followed here
        if path in seen:
            continue  # an include loop is the full parse's to report
        seen.add(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            return None
        pending += [s.filename for s in _statements_or_none(text) if isinstance(s, config_parser.IncludeStatement)]
        texts.append(text)
    return texts


class _DataLayerRefused(importlib.abc.MetaPathFinder):
    """Fails the import of a data-layer module not imported yet, as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if ".".join(name.split(".")[:2]) in _DATA_LAYER_PACKAGES:
            raise ModuleNotFoundError(f"No module named {name!r} (parsing without the data layer)", name=name)
        return None


@contextlib.contextmanager
def _data_layer_imports_refused():
    """A gin file's ``import terra.data...`` fails while it is parsed (gin's ``skip_unknown``
    then skips it) unless the module is imported already: a file includes a task config, whose
    import would load TensorFlow, and the caller parses without the data layer."""
    finder = _DataLayerRefused()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def _data_layer_names(texts: Sequence[str]) -> List[str]:
    """The names, as written in ``texts``, of bindings and references to the data layer's
    configurables (what gin is told to skip when it parses without them)."""
    from terra.gin_config import registry_file

    names = set()
    for text in texts:
        for statement in _statements_or_none(text):
            if not isinstance(statement, config_parser.BindingStatement):
                continue
            written = ([statement.selector] if statement.arg_name else []) + [
                r.name for r in _references(statement.value)
            ]
            for name in written:
                if (registry_file.full_selector(name) or "").startswith(_DATA_LAYER_PACKAGES):
                    names.add(name)
                    names.add(name.rsplit("/", 1)[-1])
    return sorted(names)


def _statements_or_none(text: str) -> List[Any]:
    """The statements of ``text``, or ``[None]`` where gin's reader cannot read it."""
    try:
        return read_statements(text)
    except (SyntaxError, ValueError, RecursionError):
        return [None]


def _references(value) -> List[Reference]:
    if isinstance(value, Reference):
        return [value]
    if isinstance(value, dict):
        return [r for v in [*value.keys(), *value.values()] for r in _references(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _references(v)]
    return []


def shipped_configs(folder: str) -> List[str]:
    """The shipped gin files of one of :data:`CONFIG_FOLDERS`, as ``folder/name.gin``."""
    path = os.path.join(CONFIGS_DIR, folder)
    names = sorted(n for n in os.listdir(path) if n.endswith(".gin")) if os.path.isdir(path) else []
    return [f"{folder}/{n}" for n in names]


def _open_url(path: str):
    from etils import epath

    return epath.Path(path).open("r")


def _is_readable_url(path: str) -> bool:
    if not files.has_scheme(path):
        return False
    from etils import epath

    return epath.Path(path).is_file()


# A run's config.gin under gs:// (terra.load, --checkpoint) is read through etils.epath, as its
# checkpoints are; gin's own reader (``open``) serves local files.
gin.config.register_file_reader(_open_url, _is_readable_url)


def shipped_file(name: str) -> Optional[str]:
    """The shipped file a package path names (``terra/configs/runs/train.gin``), or None."""
    if not name.startswith(SHIPPED_PREFIX):
        return None
    path = os.path.join(CONFIGS_DIR, name[len(SHIPPED_PREFIX) :])
    return path if os.path.isfile(path) else None


def shown_name(path: str) -> str:
    """A shipped config's package path (``terra/configs/models/tiny.gin``: the name an include
    takes), else ``path`` as given."""
    if path.startswith(CONFIGS_DIR + os.sep):
        return SHIPPED_PREFIX + os.path.relpath(path, CONFIGS_DIR).replace(os.sep, "/")
    return path


def _open_shipped(name: str):
    return open(shipped_file(name), encoding="utf-8")


# gin's package-resource reader finds ``terra/configs/...`` only where an installed package maps
# ``terra.configs``; this one finds it at CONFIGS_DIR, installed or not.
gin.config.register_file_reader(_open_shipped, shipped_file)


def resolve_gin_file(path: str, search_paths: Sequence[str] = ()) -> str:
    """The file ``path`` names: as given (absolute, or relative to the working directory), else
    under each of ``search_paths``, else among the shipped configs (by their name there,
    ``models/tiny.gin``, or their package path, ``terra/configs/models/tiny.gin``). A URL
    (``gs://...``) is only looked up as given."""
    if files.has_scheme(path):
        if _is_readable_url(path):
            return path
        raise GinConfigError(f"Gin file {path!r} not found.")
    candidates = [path] + [os.path.join(p, path) for p in (*search_paths, CONFIGS_DIR)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    if shipped_file(path):
        return shipped_file(path)
    where = ", ".join(["the working directory", *search_paths, CONFIGS_DIR])
    models = ", ".join(n.split("/", 1)[1] for n in shipped_configs("models")) or "none found"
    raise GinConfigError(
        f"Gin file {path!r} not found (looked in {where}). Shipped model configs (models/...): {models}; "
        "experiments: --gin_file=experiments/NAME.gin."
    )


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


_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.MULTILINE)


def _include_loop(path: str, chain: Sequence[str] = ()) -> List[str]:
    """The first chain of includes from ``path`` that leads back to a file on it, or []."""
    chain = [*chain, path]
    try:
        with open(path, encoding="utf-8") as f:
            names = _INCLUDE.findall(f.read())
    except (OSError, UnicodeDecodeError):
        return []
    for name in names:
        try:
            included = resolve_gin_file(name, sorted(_SEARCH_PATHS_ADDED))
        except GinConfigError:
            continue
        if included in chain:
            return [*chain[chain.index(included) :], included]
        loop = _include_loop(included, chain)
        if loop:
            return loop
    return []


def include_loop_error(path: str) -> GinConfigError:
    # gin follows includes without remembering where it has been, until Python's stack runs out
    # (its error message is then one 'In file' line per level: not something to print).
    loop = _include_loop(os.path.abspath(path))
    where = " -> ".join(loop) if loop else "the files it includes"
    return GinConfigError(
        f"Invalid gin configuration (file {path}): its includes form a loop ({where}); "
        "remove the include that leads back to a file already included."
    )


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
    data_layer: Optional[bool] = None,
) -> None:
    """Parses files then bindings into the global gin config (clearing any earlier one). An entry
    of ``gin_files`` may be a :class:`GinText` (a config already read and checked, such as a run's
    ``config.gin``): its text is parsed, the file not read again. The data layer is registered
    (TensorFlow imported) only when the config names it, or when the config is to be locked
    (``finalize``: gin takes no new configurable afterwards, so everything terra has is registered
    first). The model-only commands (``terra-params``, ``terra-bench decode``) parse unlocked.

    ``data_layer=False`` (unlocked only) parses without the data layer even where the config names
    it: its bindings and references are left out (gin's ``skip_unknown``) and its imports of it
    (a :class:`GinText`'s, a file's or an included task config's) are not run, for a caller that
    needs only the model (``terra-params`` of an experiment) or reads what it needs of the data
    layer itself (``terra.load`` of a summarization run reads its vocabulary's file and sentinel
    count)."""
    if data_layer is None:
        data_layer = finalize or names_data_layer(gin_files, gin_bindings, search_paths)
    register_terra_configurables(data_layer)
    gin.clear_config()
    add_search_paths([*search_paths, CONFIGS_DIR])
    files = [f if isinstance(f, GinText) else resolve_gin_file(f, search_paths) for f in gin_files]
    skipped, refused = (), contextlib.nullcontext()
    if not data_layer:
        texts = _config_texts(files) or [f.text for f in files if isinstance(f, GinText)]
        # The data layer's bindings and references are skipped; its imports (in a text, a file or
        # an included task config) are refused and skipped too: a non-empty skip list lets gin
        # pass over an import that fails.
        skipped = [*_data_layer_names(texts + list(gin_bindings)), *_DATA_LAYER_PACKAGES]
        refused = _data_layer_imports_refused()
    with _quiet_gin_path_probes(), refused:
        _parse_files_and_bindings(files, gin_bindings, skipped)
    check_binding_types(gin_bindings)
    _make_paths_absolute()
    if finalize:
        try:
            gin.finalize()
        except ValueError as e:  # e.g. a %gin.REQUIRED macro left unset
            raise explain_gin_error(e, "checking the parsed config") from None


def _make_paths_absolute() -> None:
    """Rebind each of :data:`PATH_PARAMETERS` bound to relative paths (a string or a list of
    them) to the same paths made absolute; URLs, ``None`` and macro references stay as they are."""
    for name in PATH_PARAMETERS:
        value = bound_value(name)
        if isinstance(value, str) and value:
            absolute = files.absolute(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
            absolute = type(value)(files.absolute(v) for v in value)
        else:
            continue
        if absolute != value:
            gin.bind_parameter(name, absolute)


def _parse_files_and_bindings(files: Sequence[Any], gin_bindings: Sequence[str], skipped: Sequence[str] = ()) -> None:
    skip = list(skipped) or False
    for path in files:
        where = f"file {path.path if isinstance(path, GinText) else path}"
        try:
            if isinstance(path, GinText):
                gin.parse_config(path.text, skip_unknown=skip)
            else:
                gin.parse_config_file(path, skip_unknown=skip)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError, IOError) as e:
            raise _explain_parse_error(e, where) from None
        except RecursionError:
            if isinstance(path, GinText):  # checked: no includes, so a value nested too deeply
                raise GinConfigError(f"Invalid gin configuration ({where}): a value is nested too deeply.") from None
            raise include_loop_error(path) from None
    for binding in gin_bindings:
        try:
            gin.parse_config(binding, skip_unknown=skip)
        except (ValueError, KeyError, TypeError, SyntaxError, ImportError, tokenize.TokenError) as e:
            raise _explain_parse_error(e, f"binding {binding!r}") from None


def check_binding_types(gin_bindings: Sequence[str]) -> None:
    """A literal of the wrong type in ``gin_bindings`` (parsed already, its configurables
    registered) as a ``GinConfigError`` naming the binding: a parameter bound directly
    (``TransformerConfig.d_model = '64'``) or through a macro (``MODEL_DIR = 5`` where
    ``Trainer.model_dir = %MODEL_DIR``). Without it the value reaches the library and fails
    there as a ``TypeError``, far from the binding."""
    macros = {}
    for binding in gin_bindings:
        for statement in _binding_statements(binding):
            if statement.arg_name:
                _check_parameter(binding, statement.selector, statement.arg_name, statement.value)
            elif not statement.scope:
                macros[statement.selector] = (binding, statement.value)
    if macros:
        _check_macro_uses(macros)


def _binding_statements(text: str) -> List[Any]:
    try:
        return [s for s in read_statements(text) if isinstance(s, config_parser.BindingStatement)]
    except SyntaxError:  # gin parsed it; a text this reader cannot is not worth failing over
        return []


def _mismatch(selector: str, name: str, value) -> Optional[str]:
    """``'Trainer.steps, which takes an int'`` when ``value`` cannot stand for that parameter."""
    try:
        fn = configurable_target(selector)
    except ValueError:
        return None
    expected = parameter_type(fn, name)
    if expected is None or fits(value, expected):
        return None
    return f"{selector.split('.')[-1]}.{name}, which takes {type_name(expected)}"


def _check_parameter(binding: str, selector: str, name: str, value) -> None:
    mismatch = _mismatch(selector, name, value)
    if mismatch:
        raise GinConfigError(
            f"Invalid gin configuration (binding {binding!r}): {value!r} is {type_name(value)}, but it is "
            f"bound to {mismatch}."
        )


def _check_macro_uses(macros) -> None:
    """Each parameter the config binds to one of ``macros`` (``{name: (binding, value)}``),
    checked against the macro's value; the bindings come from gin's own listing of the config."""
    try:
        statements = _binding_statements(gin.config_str())
    except (ValueError, TypeError):  # a value gin cannot print back
        return
    for statement in statements:
        used = statement.value
        if not (statement.arg_name and isinstance(used, MacroUse) and used.name in macros):
            continue
        binding, value = macros[used.name]
        mismatch = _mismatch(statement.selector, statement.arg_name, value)
        if mismatch:
            raise GinConfigError(
                f"Invalid gin configuration (binding {binding!r}): {value!r} is {type_name(value)}, but "
                f"{used.name} is passed to {mismatch}."
            )


def build(selector_or_fn, where: str = "building the configured object"):
    """Calls a gin configurable (a selector such as ``'terra.training.Trainer'``, or
    the callable), turning configuration errors (bad values, missing REQUIRED bindings)
    into ``GinConfigError``."""
    fn = gin.get_configurable(selector_or_fn) if isinstance(selector_or_fn, str) else selector_or_fn
    try:
        return fn()
    except (ValueError, TypeError, RuntimeError) as e:
        raise explain_gin_error(e, where) from None


def bound_value(name: str, default: Any = None) -> Any:
    """The parsed config's value of ``name`` (a parameter such as ``'terra.training.Trainer.seed'``
    or a macro ``'%TASK'``), or ``default`` where it is not bound."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def build_macro(name: str, where: str):
    """The object the parsed config's ``%name`` macro names (e.g. ``MODEL``, ``FEATURE_CONVERTER``),
    constructed as gin constructs it for a configurable that takes it; None where the config
    defines no such macro. Configuration errors are ``GinConfigError``."""
    reference = bound_value(f"%{name}")
    if reference is None:
        return None
    # gin evaluates ``%NAME`` inside the scope ``NAME`` (a macro is a scoped configurable), so a
    # run's operative config records its bindings as ``NAME/...``: build it in that scope too
    # (unscoped bindings still apply there).
    with gin.config_scope(name):
        built = build(getattr(reference, "scoped_configurable_fn", lambda: reference), where)
        return frozen.freeze_configurables(built, reference=reference)


def parse_model(gin_files: Sequence[Any], gin_bindings: Sequence[str] = (), *, search_paths: Sequence[str] = ()):
    """The model of ``gin_files`` and ``gin_bindings``, parsed unlocked and without the data layer
    (an experiment's task and run bindings are read past; TensorFlow is not imported), for a
    caller that needs only the model: parameter counts, benchmarks."""
    parse_gin(list(gin_files), list(gin_bindings), finalize=False, search_paths=search_paths, data_layer=False)
    return build_model()


def build_model(where: str = "building the model"):
    """The model the parsed config's ``MODEL`` macro names (every ``models/*.gin``
    defines it), constructed, with configuration errors as ``GinConfigError``."""
    model = build_macro("MODEL", where)
    if model is None:
        raise GinConfigError(
            "the gin config defines no MODEL; include a model config (e.g. --gin_file=models/tiny.gin)."
        )
    return model
