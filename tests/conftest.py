"""Test set-up: one CPU device (eight in the child session that runs the ``multi_device`` tests),
XLA's optimizations off, a clean gin config per test, the suite's scheduling.

Tiers: ``make test-fast`` runs ``-m "not slow"`` (a test is ``slow`` by what it costs: a training,
a subprocess, a long compile); ``make test`` runs everything. docs/contributing.md has the rules.
"""

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

# Partitioning tests ask for a mesh of MULTI_DEVICE_COUNT devices with @pytest.mark.multi_device;
# everything else runs on one device (8-way programs on 2 cores only cost compile and run time).
# The device count must be fixed before JAX initialises its backend.
MULTI_DEVICE_COUNT = 8
DEVICES_ENV = "TERRA_TEST_DEVICES"
DEVICES = int(os.environ.get(DEVICES_ENV, "1"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` less any forced host device count (a test or session sets its own)."""
    return " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


# XLA:CPU's fusion emitters (MLIR) compile each small program ~30% slower than the classic
# emitters, and the suite compiles thousands of small programs; the two compute alike.
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"
_flags = without_device_count(os.environ.get("XLA_FLAGS", ""))
if FAST_COMPILE_FLAGS.split("=")[0] not in _flags:  # a child session inherits them; a user's own wins
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

import flax.linen as nn  # noqa: E402
import gin  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

from terra.models import EncoderDecoderModel, EncoderDecoderTransformer, TransformerConfig  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny encoder-decoder for the copy task's byte vocabulary (259 ids), as gin bindings.
TINY_COPY_MODEL = [
    "TransformerConfig.vocab_size = 259",
    "TransformerConfig.d_model = 32",
    "TransformerConfig.d_ff = 64",
    "TransformerConfig.n_heads = 4",
    "TransformerConfig.n_encoder_layers = 1",
    "TransformerConfig.n_decoder_layers = 1",
    "TransformerConfig.max_len = 64",
]


# The multi_device child session's files (its results and log), shared by the xdist workers the
# same way as the compilation cache: made by the first process, inherited by the others.
_OWN_MULTI_DEVICE_DIR = None
if "TERRA_TEST_MULTI_DEVICE_DIR" not in os.environ:
    _OWN_MULTI_DEVICE_DIR = tempfile.mkdtemp(prefix="terra-test-multi-device-")
    os.environ["TERRA_TEST_MULTI_DEVICE_DIR"] = _OWN_MULTI_DEVICE_DIR
MULTI_DEVICE_DIR = os.environ["TERRA_TEST_MULTI_DEVICE_DIR"]


def pytest_configure(config):
    config.pluginmanager.register(SlowByMeasure(), "terra-slow-by-measure")
    config.addinivalue_line(
        "markers", "slow: costs seconds (a training, a subprocess, a long compile); make test-fast deselects it"
    )
    config.addinivalue_line(
        "markers",
        f"multi_device: needs a mesh of {MULTI_DEVICE_COUNT} CPU devices; runs in a "
        f"child session with {DEVICES_ENV}={MULTI_DEVICE_COUNT}",
    )


def pytest_unconfigure(config):
    # The process that made the caches (the xdist controller, or pytest without xdist).
    if not hasattr(config, "workerinput"):
        import shutil

        for own in (_OWN_COMPILATION_CACHE, _OWN_MULTI_DEVICE_DIR):
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)


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


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: order and delegate what will run
def pytest_collection_modifyitems(config, items):
    """The costliest files go first (measured, or estimated from their ``slow`` marks); the
    ``multi_device`` tests start their child session as soon as they are collected and go to the
    end of their files."""
    measured = _measured_durations()
    cost, delegated_files = {}, set()
    for item in items:
        guess = ESTIMATED_SECONDS["slow" if item.get_closest_marker("slow") else "fast"]
        cost[item.fspath] = cost.get(item.fspath, 0.0) + measured.get(item.nodeid, guess)
        if item.get_closest_marker("multi_device") and DEVICES < MULTI_DEVICE_COUNT:
            delegated_files.add(item.fspath)
    # A file's multi_device tests (which report the child session's results) go to its end, and no
    # such file is among the first each worker gets: by the time a worker reaches them the child,
    # started now, has finished, so no worker waits for it, and the files keep their costly-first
    # places (a long file scheduled last would leave the other worker idle).
    files = sorted(cost, key=lambda p: -cost[p])
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    for path in [p for p in files[:workers] if p in delegated_files]:
        files.remove(path)
        files.insert(min(workers, len(files)), path)
    order = {path: rank for rank, path in enumerate(files)}

    def place(item):
        return order[item.fspath], item.fspath in delegated_files and bool(item.get_closest_marker("multi_device"))

    items.sort(key=place)  # stable: each file keeps its own order otherwise
    if DEVICES < MULTI_DEVICE_COUNT:
        delegated = [item.nodeid for item in items if item.get_closest_marker("multi_device")]
        if delegated:
            _start_multi_device_session(config, delegated)


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


# ----- the multi_device tests: one child session with its own device count ------------------------

_RESULTS = "results.json"
_CHILD = None  # the child session, in the process that started it


def _reap_child(timeout: float = 1800.0):
    """Waits for the child session where this process started it: its CPU time then counts in the
    suite's total, not in the test whose own subprocess would otherwise reap it. A child still
    running after ``timeout`` (hung: its tests report that they got no results) is killed."""
    global _CHILD
    if _CHILD is not None:
        try:
            _CHILD.wait(timeout)
        except subprocess.TimeoutExpired:
            _CHILD.kill()
            _CHILD.wait()
        _CHILD = None


def _start_multi_device_session(config, nodeids):
    """The first process to get here starts the child session for every multi_device test; the
    others (xdist workers collect the same tests) find it started."""
    try:
        marker = os.open(os.path.join(MULTI_DEVICE_DIR, "started"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    env = dict(
        os.environ,
        **{
            DEVICES_ENV: str(MULTI_DEVICE_COUNT),
            "XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS", "")),
            "TERRA_TEST_RESULTS": os.path.join(MULTI_DEVICE_DIR, _RESULTS),
        },
    )
    global _CHILD
    with open(os.path.join(MULTI_DEVICE_DIR, "log"), "wb") as log:
        _CHILD = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *nodeids],
            cwd=str(config.rootpath),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    os.write(marker, str(_CHILD.pid).encode())
    os.close(marker)


def _multi_device_results(timeout: float = 1800.0):
    """``{nodeid: [(when, outcome, text), ...]}`` from the child session, waiting for it."""
    path = os.path.join(MULTI_DEVICE_DIR, _RESULTS)
    started = os.path.join(MULTI_DEVICE_DIR, "started")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        pid = open(started).read().strip() if os.path.exists(started) else ""
        alive = True
        if _CHILD is not None:  # this process's child: a finished one is a zombie until waited for
            alive = _CHILD.poll() is None or os.path.exists(path)
        elif pid:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                alive = os.path.exists(path)
        if not alive or time.monotonic() > deadline:
            log = open(os.path.join(MULTI_DEVICE_DIR, "log"), errors="replace").read()[-4000:]
            return {"error": f"the multi_device child session ended without results:\n{log}"}
        time.sleep(0.2)
    _reap_child()
    with open(path) as f:
        return json.load(f)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A multi_device test in a one-device process reports what the child session measured."""
    if DEVICES >= MULTI_DEVICE_COUNT or not item.get_closest_marker("multi_device"):
        return None
    from _pytest.reports import TestReport

    results = _multi_device_results()
    phases = results.get(item.nodeid) or [("call", "failed", results.get("error", "the child session did not run it"))]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for when, outcome, text in phases:
        longrepr = None
        if outcome == "skipped":
            longrepr = (str(item.path), item.location[1] or 0, text)
        elif outcome == "failed":
            longrepr = f"[in the {MULTI_DEVICE_COUNT}-device child session]\n{text}"
        report = TestReport(item.nodeid, item.location, {}, outcome, longrepr, when)
        item.ihook.pytest_runtest_logreport(report=report)
    # What the runner's teardown does: finish the fixtures the next test does not share.
    item.session._setupstate.teardown_exact(nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


# ----- the suite's CPU time: per test (its process and the subprocesses it waited for) and in all --

_SUITE_START = time.perf_counter()
_TEST_CPU = {}  # nodeid -> CPU seconds, as the workers report them


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
        outcome.get_result().user_properties.append(("cpu_seconds", round(getattr(item, "cpu_seconds", 0.0), 3)))


def pytest_terminal_summary(terminalreporter, config):
    """The suite's CPU time (what docs/contributing.md budgets): every process's user and system
    seconds, the workers and the subprocesses tests start included, and the tests that took most."""
    if hasattr(config, "workerinput") or not _TEST_CPU:
        return
    total = _cpu_seconds()
    wall = time.perf_counter() - _SUITE_START
    tests = sum(_TEST_CPU.values())
    write = terminalreporter.write_line
    write(
        f"suite CPU time: {total / 60:.1f} CPU-minutes in {wall / 60:.1f} minutes of wall time "
        f"({tests / 60:.1f} of them in the {len(_TEST_CPU)} tests themselves, the rest start-up and collection)"
    )
    for nodeid, seconds in sorted(_TEST_CPU.items(), key=lambda kv: -kv[1])[:10]:
        write(f"  {seconds:7.1f} CPU-s  {nodeid}")
    if config.getoption("cpu_report"):
        with open(config.getoption("cpu_report"), "w") as f:
            json.dump({"total_cpu_seconds": round(total, 1), "wall_seconds": round(wall, 1), "tests": _TEST_CPU}, f)


_CHILD_REPORTS = {}


def pytest_runtest_logreport(report):
    _record_duration(report)
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _TEST_CPU[report.nodeid] = value
    if "TERRA_TEST_RESULTS" in os.environ and DEVICES >= MULTI_DEVICE_COUNT:
        text = report.longreprtext if report.outcome != "skipped" else str(report.longrepr[-1])
        _CHILD_REPORTS.setdefault(report.nodeid, []).append((report.when, report.outcome, text))


def pytest_sessionfinish(session):
    _reap_child()
    _store_durations(session.config)
    path = os.environ.get("TERRA_TEST_RESULTS")
    if path and DEVICES >= MULTI_DEVICE_COUNT:
        with open(path + ".tmp", "w") as f:
            json.dump(_CHILD_REPORTS, f)
        os.replace(path + ".tmp", path)


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def tiny_config(**overrides) -> TransformerConfig:
    values = dict(
        vocab_size=61,
        d_model=32,
        d_ff=64,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        max_len=64,
        dropout=0.0,
        ff_dropout=0.0,
        attention_dropout=0.0,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def dropout_calls(apply, *args) -> set:
    """``(parent module class name, rate, broadcast_dims)`` of every ``nn.Dropout`` with a
    non-zero rate that ``apply(*args)`` calls; traced with abstract ``args``, not run."""
    calls = set()

    def record(next_fun, fn_args, fn_kwargs, context):
        module = context.module
        if isinstance(module, nn.Dropout) and context.method_name == "__call__" and module.rate > 0:
            calls.add((type(module.parent).__name__, module.rate, tuple(module.broadcast_dims)))
        return next_fun(*fn_args, **fn_kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(apply, *args)
    return calls


@contextlib.contextmanager
def xla_optimizations(enabled: bool):
    """XLA's optimizations on or off for what is compiled inside the block."""
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not enabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def quantize_for_setup(w, kind: str, transposed: bool = False):
    """Narrow weights for a test's set-up, not under test (a module under ``optimized_compile``):
    ``quantize`` as one program per shape, compiled without XLA's optimizations."""
    from terra.quantization import quantize_compiled

    with xla_optimizations(False):
        return quantize_compiled(w, kind, transposed=transposed)


@functools.cache
def _quantize_params_compiled():
    from terra.quantization import quantize_params

    return jax.jit(quantize_params, static_argnums=1)


def quantize_params_for_setup(params, kind: str):
    """A parameter tree narrowed for a test's set-up: ``quantize_params`` compiled whole (leaf by
    leaf it compiles one program per weight shape), without XLA's optimizations."""
    with xla_optimizations(False):
        return _quantize_params_compiled()(params, kind)


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


# A study's smoke batches of 4 train on one device whatever the process has.
ONE_DEVICE = "--gin.terra.training.ParallelSettings.num_devices=1"


def is_png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"
