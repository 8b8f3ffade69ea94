"""The package's shape: imports only point down, no loops, no private names across modules,
package ``__init__`` files without side effects, gin names that say where things live.

The import graph is read from the source (``ast``), every import statement counted, those
inside functions included: an import hidden in a function body is still a dependency.
"""

import ast
import os
import pkgutil
from typing import Dict, Set

import pytest

import terra

PACKAGE_DIR = os.path.dirname(os.path.abspath(terra.__file__))

# Lower layers of the library never reach into the layers built on them (directly or through
# another module).
LOWER = ("terra.layers", "terra.models", "terra.decoding")
UPPER = ("terra.training", "terra.evaluation", "terra.benchmarks", "terra.reproduce")
# The trainer is below evaluation, benchmarks and studies: evaluation plugs into it as hooks.
TRAINING = ("terra.training",)
ABOVE_TRAINING = ("terra.evaluation", "terra.benchmarks", "terra.reproduce")


def _modules() -> Dict[str, str]:
    """``{dotted module name: file path}`` for every module of the package."""
    found = {"terra": os.path.join(PACKAGE_DIR, "__init__.py")}
    for info in pkgutil.walk_packages([PACKAGE_DIR], prefix="terra."):
        relative = info.name.split(".")[1:]
        base = os.path.join(PACKAGE_DIR, *relative)
        found[info.name] = os.path.join(base, "__init__.py") if info.ispkg else base + ".py"
    return found


MODULES = _modules()


def _parse(name: str) -> ast.Module:
    with open(MODULES[name], encoding="utf-8") as f:
        return ast.parse(f.read(), MODULES[name])


def _resolve(name: str) -> str:
    """The module a dotted name refers to: itself if it is a module, else its longest module prefix."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(name: str) -> Set[str]:
    """The terra modules ``name`` imports anywhere in its source."""
    out = set()
    is_package = MODULES[name].endswith("__init__.py")
    for node in ast.walk(_parse(name)):
        if isinstance(node, ast.Import):
            out.update(_resolve(a.name) for a in node.names if a.name.startswith("terra"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if not module.startswith("terra"):
                continue
            for alias in node.names:
                target = f"{module}.{alias.name}"
                out.add(target if target in MODULES else _resolve(module))
    out.discard(name)
    out.discard("")
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _reachable(start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_import_graph_has_no_loops():
    # Tarjan's strongly connected components: any component of two or more modules is a loop.
    index, low, stack, on_stack, loops = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not loops, f"import loops: {loops}"


# Packages whose modules sit on different floors, each a unit of its own as a top-level module
# is: terra.gin_config holds what every floor reads (gin text, the stored registry, freezing,
# below the models and training) and what sits above them all (the registration, which imports
# every configurable's package, and the parsing that runs it).
PACKAGES_OF_FLOORS = ("terra.gin_config",)


def _subpackage(module: str) -> str:
    """``terra.cli`` for ``terra.cli.convert``; a top-level module, or a module of a package in
    ``PACKAGES_OF_FLOORS``, is its own unit."""
    if _in(module, PACKAGES_OF_FLOORS):
        return module
    return ".".join(module.split(".")[:2])


def test_no_two_subpackages_import_each_other():
    # Modules can avoid a loop while their packages close one (terra.convert's command line
    # importing terra.cli, whose convert command imports terra.convert): the packages are the
    # floors of the architecture, so they are checked as units too. The root package re-exports
    # the public API and is left out.
    units: Dict[str, Set[str]] = {}
    for module, targets in GRAPH.items():
        if module != "terra":
            source = _subpackage(module)
            units.setdefault(source, set()).update(_subpackage(t) for t in targets if t != "terra")
    for source in units:
        units[source].discard(source)

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in units.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    loops = sorted(f"{a} -> {b} -> {a}" for a in units for b in units[a] if a < b and a in reachable(b))
    assert not loops, f"subpackage loops: {loops}"


@pytest.mark.parametrize(
    "lower, upper", [(LOWER, UPPER), (TRAINING, ABOVE_TRAINING)], ids=["layers-models-decoding", "training"]
)
def test_lower_layers_never_import_the_layers_built_on_them(lower, upper):
    wrong = {name: sorted(m for m in _reachable(name) if _in(m, upper)) for name in MODULES if _in(name, lower)}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"modules of {lower} reach {upper}: {wrong}"


def test_layers_reach_the_machine_only_through_the_backend_primitives():
    """A layer writes its decode step in the primitives of ``terra.backends``: no module of
    ``terra.layers`` imports the native kernels, a backend's module or the weight stores of
    ``terra.quantization`` (which backend runs a primitive, and for which weights, is the backend
    package's business)."""
    beyond = ("terra.quantization", "terra.backends")
    wrong = {
        name: sorted(t for t in GRAPH[name] if _in(t, beyond) and t != "terra.backends")
        for name in MODULES
        if _in(name, ("terra.layers",))
    }
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"layers reaching past terra.backends' primitives: {wrong}"
    assert "terra.backends.native_kernels" in MODULES  # the name checked above is the kernels' module


# A layer's method is read whole by whoever changes it: one that outgrows a screen is split along
# its own steps (as LSHSelfAttention's decode step is: create, prefill, step, write).
LONGEST_LAYER_FUNCTION = 60


def test_no_function_in_the_layers_is_longer_than_a_screen():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name in MODULES
        if _in(name, ("terra.layers",))
        for node in ast.walk(_parse(name))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST_LAYER_FUNCTION
    ]
    assert not long, long


def test_the_checker_sees_imports_inside_functions():
    # The trainer-evaluator loop the issue found was an import inside a function body.
    source = "def f():\n    from terra.evaluation import evaluator\n"
    names = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert names == {"terra.evaluation"}
    assert _resolve("terra.evaluation.evaluator") == "terra.evaluation.evaluator"


def test_no_private_name_is_imported_or_used_across_modules():
    """No ``from terra.x import _name``, and no ``obj._name`` on anything but ``self``/``cls``
    (names of third-party modules aside: those are the next item's business, not terra's)."""
    problems = []
    for name in MODULES:
        tree = _parse(name)
        third_party = set()  # local names bound to modules outside terra
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if not (node.module or "").startswith("terra") and not node.level:
                        third_party.add(alias.asname or alias.name)
                    elif target not in MODULES and alias.name.startswith("_"):
                        problems.append(f"{name} imports {target}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if not alias.name.startswith("terra"):
                        third_party.add((alias.asname or alias.name).split(".")[0])
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in {"self", "cls"} | third_party:
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            problems.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    assert not problems, "private names crossing modules:\n  " + "\n  ".join(problems)


def test_package_init_files_only_import_and_declare():
    """``import terra.x`` registers and re-exports; it never runs set-up code (redirecting
    file descriptors, configuring TensorFlow, ...)."""
    allowed = (ast.Import, ast.ImportFrom)
    for name, path in MODULES.items():
        if not path.endswith("__init__.py"):
            continue
        for node in _parse(name).body:
            if isinstance(node, allowed):
                continue
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                continue  # the docstring
            if isinstance(node, ast.Assign) and all(
                isinstance(t, ast.Name) and t.id in ("__all__", "__version__") for t in node.targets
            ):
                continue
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                continue  # PEP 562 lazy attributes: defining one runs nothing
            raise AssertionError(f"{path}:{node.lineno} runs code on import ({ast.dump(node)[:80]}...)")


def _imports_gin(name: str) -> bool:
    for node in ast.walk(_parse(name)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "gin" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "gin":
            return True
    return False


def test_layers_and_models_are_plain_python_registered_with_gin_in_one_place():
    # terra/gin_config/registration.py registers them; a layer or model reading gin's global config would
    # make a built model depend on whatever config is parsed later.
    with_gin = sorted(name for name in MODULES if _in(name, ("terra.layers", "terra.models")) and _imports_gin(name))
    assert not with_gin, f"modules of terra.layers or terra.models that import gin: {with_gin}"
    assert _imports_gin("terra.gin_config.registration")
    assert {"terra.layers", "terra.models"} <= GRAPH["terra.gin_config.registration"]


def test_the_package_library_has_no_test_doubles():
    for name in MODULES:
        for node in ast.walk(_parse(name)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith("unittest") for n in names), f"{name} imports unittest"
