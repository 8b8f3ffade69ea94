"""Test set-up: one CPU device (eight in the session that runs the ``multi_device`` tests),
XLA's optimizations off, a clean gin config per test, the suite's scheduling and CPU account.

Tiers: ``make test-fast`` runs ``-m "not slow"`` (a test is ``slow`` by what it costs: a training,
a subprocess, a long compile); ``make test`` runs everything. docs/contributing.md has the rules.
"""

import json
import os
import tempfile
import time

# Partitioning tests ask for a mesh of MULTI_DEVICE_COUNT devices with @pytest.mark.multi_device;
# everything else runs on one device (8-way programs on 2 cores only cost compile and run time).
# The device count must be fixed before JAX initialises its backend.
MULTI_DEVICE_COUNT = 8
DEVICES_ENV = "TERRA_TEST_DEVICES"
DEVICES = int(os.environ.get(DEVICES_ENV, "1"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from helpers import tiny_config, without_device_count, xla_optimizations  # noqa: E402  (no JAX at import)

# XLA:CPU's fusion emitters (MLIR) compile each small program ~30% slower than the classic
# emitters, and the suite compiles thousands of small programs; the two compute alike.
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"
_flags = without_device_count(os.environ.get("XLA_FLAGS", ""))
if FAST_COMPILE_FLAGS.split("=")[0] not in _flags:  # a subprocess inherits them; a user's own wins
    _flags += " " + FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's optimizations only cost compile time at test sizes; the subprocesses tests start inherit
# this too, so a run in a subprocess and one in the test compute alike. Modules that inspect
# optimized programs or time kernels opt back in (the ``optimized_compile`` fixture).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# JAX records the Python stack of every traced operation as its source location in the lowered
# program; no test reads those locations, and collecting them is ~8% of tracing and lowering.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
# The embedded corpus and its vocabulary are built once per test session, not in the user's cache.
if "TERRA_CACHE_DIR" not in os.environ:
    os.environ["TERRA_CACHE_DIR"] = tempfile.mkdtemp(prefix="terra-test-cache-")
# XLA compilation is most of the suite's time, and many tests compile the same tiny programs (each
# Trainer, model and subprocess jits its own functions): one persistent compilation cache per
# session, shared by the xdist workers and the subprocesses the tests start (they inherit the
# environment), compiles each program once. It starts empty and is removed when the session ends,
# so every run compiles from scratch.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="terra-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import gin  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from terra.models import EncoderDecoderModel, EncoderDecoderTransformer  # noqa: E402


def pytest_configure(config):
    _account_jax_phases()
    config.pluginmanager.register(SlowByMeasure(), "terra-slow-by-measure")
    config.addinivalue_line(
        "markers", "slow: costs seconds (a training, a subprocess, a long compile); make test-fast deselects it"
    )
    config.addinivalue_line(
        "markers",
        f"multi_device: needs a mesh of {MULTI_DEVICE_COUNT} CPU devices; runs in a session "
        f"started with {DEVICES_ENV}={MULTI_DEVICE_COUNT} (make test's second), skipped in others",
    )


def pytest_unconfigure(config):
    # The process that made the caches (the xdist controller, or pytest without xdist).
    if not hasattr(config, "workerinput"):
        import shutil

        if _OWN_COMPILATION_CACHE is not None:
            shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)


# ----- the suite's order: the costliest files first, so two workers finish together --------------

# Seconds each test took (set-up, call and teardown), measured on a 2-core machine; pytest
# --store-durations rewrites it. xdist hands out whole files in collection order (make test passes
# --no-loadscope-reorder), so putting the longest files first is the longest-processing-time
# schedule. A test not in it is estimated from its slow mark.
DURATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
ESTIMATED_SECONDS = {"slow": 5.0, "fast": 0.2}


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="write the seconds each test took to tests/durations.json (the suite's schedule)",
    )
    parser.addoption("--cpu-report", default=None, help="write every test's CPU seconds (and the suite's) to this JSON")


def _measured_durations() -> dict:
    try:
        with open(DURATIONS_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


# The unit tier's bar: a test that took more than this many seconds in the stored durations is
# ``slow`` whatever its marks say, so ``make test-fast`` stays an edit-test loop of seconds
# (docs/contributing.md, "What makes a test slow").
FAST_TEST_SECONDS = 1.0


class SlowByMeasure:
    """Marks ``slow`` every test whose measured seconds exceed ``FAST_TEST_SECONDS`` (a plugin of
    its own: this file's ``pytest_collection_modifyitems`` runs last, this one must run first)."""

    @pytest.hookimpl(tryfirst=True)  # before -m selects by marks
    def pytest_collection_modifyitems(self, items):
        measured = _measured_durations()
        for item in items:
            if measured.get(item.nodeid, 0.0) > FAST_TEST_SECONDS and not item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: order what will run
def pytest_collection_modifyitems(config, items):
    """The costliest files go first (measured, or estimated from their ``slow`` marks); a
    ``multi_device`` test in a session without its devices is skipped, saying how to run it."""
    measured = _measured_durations()
    cost = {}
    for item in items:
        guess = ESTIMATED_SECONDS["slow" if item.get_closest_marker("slow") else "fast"]
        cost[item.fspath] = cost.get(item.fspath, 0.0) + measured.get(item.nodeid, guess)
        if item.get_closest_marker("multi_device") and DEVICES < MULTI_DEVICE_COUNT:
            item.add_marker(pytest.mark.skip(reason=MULTI_DEVICE_SKIP))
    order = {path: rank for rank, path in enumerate(sorted(cost, key=lambda p: -cost[p]))}
    items.sort(key=lambda item: order[item.fspath])  # stable: each file keeps its own order


# The device count is fixed when JAX starts, so the partitioning tests run in a session of their
# own: `make test` runs it after the others (docs/contributing.md, "Devices").
MULTI_DEVICE_SKIP = (
    f"needs {MULTI_DEVICE_COUNT} CPU devices: `make test` runs it, or "
    f"`{DEVICES_ENV}={MULTI_DEVICE_COUNT} pytest -m multi_device tests`"
)


_TEST_SECONDS = {}


def _record_duration(report):
    """Adds a test phase's seconds to the test's total."""
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def _store_durations(config):
    # The process that reports every result: the xdist controller, or pytest without xdist.
    if not config.getoption("store_durations") or hasattr(config, "workerinput") or not _TEST_SECONDS:
        return
    durations = _measured_durations()
    durations.update({nodeid: round(seconds, 2) for nodeid, seconds in _TEST_SECONDS.items()})
    with open(DURATIONS_FILE, "w") as f:
        json.dump(dict(sorted(durations.items())), f, indent=1)
        f.write("\n")


# ----- the suite's CPU time: per test (its process and the subprocesses it waited for) and in all --

_SUITE_START = time.perf_counter()
_TEST_CPU = {}  # nodeid -> CPU seconds, as the workers report them
_TEST_JAX = {}  # nodeid -> JAX's phases in the test's own process


def _cpu_seconds() -> float:
    """User and system seconds of this process and of the children it has waited for."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _counted(item):
    """A hook wrapper's body: adds the CPU seconds of the phase it wraps to the test's."""
    start = _cpu_seconds()
    yield
    item.cpu_seconds = getattr(item, "cpu_seconds", 0.0) + _cpu_seconds() - start


# Where a test process's seconds went by JAX's own events: tracing, lowering to MLIR, XLA
# compilation (or its retrieval from the persistent cache), and the programs compiled and found in
# the cache; the rest of a test's CPU time is running programs, Python, TensorFlow and subprocesses.
JAX_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_seconds",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_seconds",
    "/jax/core/compile/backend_compile_duration": "compile_seconds",
}
_JAX_ACCOUNT = {}  # the running test's figures


def _add(name, value):
    _JAX_ACCOUNT[name] = _JAX_ACCOUNT.get(name, 0) + value


def _account_jax_phases():
    def duration(event, seconds, **_):
        if event in JAX_PHASES:
            _add(JAX_PHASES[event], seconds)
        if event == "/jax/core/compile/backend_compile_duration":  # one per program, compiled or read from the cache
            _add("programs", 1)

    def count(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _add("cache_hits", 1)

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_event_listener(count)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _counted(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _counted(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from _counted(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":  # the test's whole CPU time travels to the controller with its last report
        properties = outcome.get_result().user_properties
        properties.append(("cpu_seconds", round(getattr(item, "cpu_seconds", 0.0), 3)))
        properties.append(("jax", {name: round(value, 3) for name, value in _JAX_ACCOUNT.items()}))
        _JAX_ACCOUNT.clear()


# `make test` runs two sessions (the second for the multi_device tests); each adds its figures to
# the file this names, and the last prints the suite's total.
CPU_LEDGER_ENV = "TERRA_TEST_CPU_LEDGER"


def _sessions_so_far(session: dict) -> list:
    """This session's figures after those of the earlier sessions of the same run, if any."""
    path = os.environ.get(CPU_LEDGER_ENV)
    if not path:
        return [session]
    try:
        with open(path) as f:
            sessions = json.load(f)
    except (OSError, ValueError):  # the first session: an empty file
        sessions = []
    sessions.append(session)
    with open(path, "w") as f:
        json.dump(sessions, f)
    return sessions


def _machine() -> str:
    """The machine the suite's figures come from: CPU model, cores, vector extensions and its read
    bandwidth, measured as the session ends (``terra.benchmarks.bandwidth`` over a 256 MiB buffer,
    far larger than a last-level cache, optimized as the benchmarks compile it: about a second)."""
    from terra.benchmarks import bandwidth

    machine = bandwidth.describe_machine()
    described = f"{machine['cpu']}, {machine['cores']} cores, {machine['isa'] or 'no AVX2'}"
    try:
        with xla_optimizations(True):
            rate = bandwidth.measure_read_bandwidth(256 << 20, repeats=3)
    except Exception as e:  # the figures above stand without it
        return f"{described}; read bandwidth not measured ({type(e).__name__}: {e})"
    return f"{described}; read bandwidth {rate / 1e9:.0f} GB/s (measured as the session ended)"


def pytest_terminal_summary(terminalreporter, config):
    """The suite's CPU time (what docs/contributing.md budgets): every process's user and system
    seconds, the workers and the subprocesses tests start included, and the tests that took most."""
    if hasattr(config, "workerinput") or not _TEST_CPU:
        return
    session = {
        "cpu_seconds": _cpu_seconds(),
        "wall_seconds": time.perf_counter() - _SUITE_START,
        "tests": _TEST_CPU,
        "jax": _TEST_JAX,
    }
    sessions = _sessions_so_far(session)
    total = sum(s["cpu_seconds"] for s in sessions)
    wall = sum(s["wall_seconds"] for s in sessions)
    tests = {nodeid: seconds for s in sessions for nodeid, seconds in s["tests"].items()}
    in_sessions = f" over {len(sessions)} pytest sessions" if len(sessions) > 1 else ""
    in_tests = sum(tests.values()) / 60
    write = terminalreporter.write_line
    write(
        f"suite CPU time: {total / 60:.1f} CPU-minutes in {wall / 60:.1f} minutes of wall time{in_sessions} "
        f"({in_tests:.1f} of them in the {len(tests)} tests themselves, the rest start-up and collection)"
    )
    phases = {}
    for s in sessions:
        for figures in s.get("jax", {}).values():
            for name, value in figures.items():
                phases[name] = phases.get(name, 0) + value
    write(
        f"  of which JAX in the test processes: tracing {phases.get('trace_seconds', 0) / 60:.1f}, lowering "
        f"{phases.get('lower_seconds', 0) / 60:.1f}, XLA compilation {phases.get('compile_seconds', 0) / 60:.1f} "
        f"CPU-minutes ({phases.get('programs', 0) - phases.get('cache_hits', 0):,} programs compiled, "
        f"{phases.get('cache_hits', 0):,} read from the persistent cache); the rest runs programs, Python, "
        "TensorFlow and subprocesses"
    )
    write(f"  on {_machine()}")
    for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:10]:
        write(f"  {seconds:7.1f} CPU-s  {nodeid}")
    if config.getoption("cpu_report"):
        with open(config.getoption("cpu_report"), "w") as f:
            jax_phases = {nodeid: figures for s in sessions for nodeid, figures in s.get("jax", {}).items()}
            report = {"total_cpu_seconds": round(total, 1), "wall_seconds": round(wall, 1), "tests": tests}
            json.dump({**report, "jax": jax_phases}, f)


def pytest_runtest_logreport(report):
    _record_duration(report)
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _TEST_CPU[report.nodeid] = value
        elif name == "jax":
            _TEST_JAX[report.nodeid] = value


def pytest_sessionfinish(session):
    _store_durations(session.config)


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def fast_compile():
    """XLA's optimizations off for a test module: at test sizes they only cost compile time.
    The suite's default (JAX_DISABLE_MOST_OPTIMIZATIONS above); a module states it with
    ``pytestmark = pytest.mark.usefixtures("fast_compile")``."""
    with xla_optimizations(False):
        yield


@pytest.fixture(scope="module")
def optimized_compile():
    """XLA's optimizations on for a module that inspects optimized programs (fusion, aliasing) or
    compares hand-written kernels with XLA's own products. What such a module only sets up (a
    model's random parameters) it compiles inside ``xla_optimizations(False)``: optimizing a
    model's initializer costs seconds and changes none of its bits."""
    with xla_optimizations(True):
        yield


@pytest.fixture
def native_kernels_on(monkeypatch):
    """The native kernels as a default install has them, whatever ``TERRA_NATIVE_KERNELS`` the
    shell sets (a test of them fails, rather than skips, where they are not built), with the best
    instruction set again after the test; a module states it with
    ``pytestmark = pytest.mark.usefixtures("native_kernels_on")``."""
    from terra.backends import native_kernels

    switched = native_kernels.ENV_SWITCH in os.environ
    monkeypatch.delenv(native_kernels.ENV_SWITCH, raising=False)
    if switched:
        native_kernels._library.cache_clear()
    if not native_kernels.available():
        pytest.fail(f"the native kernels are not available: {native_kernels.REBUILD}")
    yield
    native_kernels.use_isa(native_kernels.ISAS[-1])
    if switched:
        native_kernels._library.cache_clear()


@pytest.fixture
def no_tensorflow(monkeypatch):
    """Past its checks a command imports TensorFlow first: here that fails the test instead."""
    from terra import tensorflow_setup

    def refuse():
        raise AssertionError("the command got past its checks and went on to import TensorFlow")

    monkeypatch.setattr(tensorflow_setup, "import_tensorflow_quietly", refuse)


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny dense encoder-decoder and its random parameters, shared by the suite."""
    model = EncoderDecoderModel(EncoderDecoderTransformer(tiny_config()))
    return model, model.init_params(jax.random.key(0))
