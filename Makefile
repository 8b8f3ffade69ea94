# terra: `make run` and `make test` set up .venv on first use (pinned requirements plus the
# package in editable mode, which installs the terra-* commands into .venv/bin) and reuse it
# afterwards; a changed requirements.txt, setup.cfg, setup.py, pyproject.toml or native kernel
# source triggers a reinstall (the editable install also builds the kernels, see setup.py).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.terra-installed
# Keep JAX on the CPU and quiet TensorFlow's start-up logging.
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: run test test-fast test-durations gin-registry lint format bench bench-input bench-train params reproduce reproduce-sparsity reproduce-length clean install

install: $(STAMP)

$(STAMP): requirements.txt setup.cfg setup.py pyproject.toml $(wildcard terra/backends/native/*.cc terra/backends/native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --quiet --upgrade pip
	$(PY) -m pip install --disable-pip-version-check --quiet -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The quick start: pretrain, fine-tune, evaluate, then time dense against fully sparse decoding.
run: $(STAMP)
	$(BIN)/terra-quickstart

# Two workers: most of the suite's time is single-threaded XLA compilation. Whole files go to a
# worker (a module compiles its shared model once) in the order tests/conftest.py gives them, the
# costliest first by tests/durations.json (xdist's own reordering by test count is off).
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The whole suite, what CI runs (docs/contributing.md): everything on one device, then the
# partitioning tests (@pytest.mark.multi_device) in a session of their own with eight, as JAX fixes
# the device count when it starts. The second session prints the CPU time of both; a failure in
# either fails the target after both have run. CPU_REPORT=PATH writes every test's CPU seconds and
# JAX phases there (docs/benchmarks/test_suite/cpu_by_test.json is one).
MULTI_DEVICE_TESTS = $(shell grep -l "pytest.mark.multi_device" tests/test_*.py)
test: $(STAMP) lint
	@ledger=$$(mktemp) && trap 'rm -f "$$ledger"' EXIT && export TERRA_TEST_CPU_LEDGER="$$ledger" && status=0 && \
	$(PYTEST) -m "not multi_device" --durations=15 tests || status=1; \
	TERRA_TEST_DEVICES=8 $(PYTEST) -m multi_device --durations=5 $(if $(CPU_REPORT),--cpu-report=$(CPU_REPORT)) \
		$(MULTI_DEVICE_TESTS) || status=1; \
	exit $$status

# The unit tier for the edit-test loop: everything not marked slow.
test-fast: $(STAMP) lint
	$(PYTEST) -m "not slow" --durations=10 tests

# Rewrites tests/durations.json (the schedule, and the unit tier's membership: a test over a second
# is slow) from what each test took in the whole suite, then in the unit tier twice, where a test
# may pay for its module's set-up alone and so leaves the tier.
test-durations: $(STAMP)
	$(PYTEST) -m "not multi_device" --store-durations tests
	TERRA_TEST_DEVICES=8 $(PYTEST) -m multi_device --store-durations $(MULTI_DEVICE_TESTS)
	$(PYTEST) -m "not slow" --store-durations tests
	$(PYTEST) -m "not slow" --store-durations tests

# The stored list of terra's gin configurables (--gin overrides are checked against it before the
# heavy imports); rewrite it after adding or changing a configurable (tests/test_cli.py compares).
gin-registry: $(STAMP)
	$(PY) scripts/write_gin_registry.py

# ruff, configured in pyproject.toml: the linter and the formatter's check.
lint: $(STAMP)
	$(BIN)/ruff check terra tests
	$(BIN)/ruff format --check terra tests

format: $(STAMP)
	$(BIN)/ruff check --fix terra tests
	$(BIN)/ruff format terra tests

bench: $(STAMP)
	$(BIN)/terra-bench decode --preset paper_800m --out out/decode_speed

bench-input: $(STAMP)
	$(BIN)/terra-bench input --out out/input_pipeline

bench-train: $(STAMP)
	$(BIN)/terra-bench train --out out/train_speed

# The paper's claims at CPU size (docs/reproduction.md).
reproduce: reproduce-sparsity reproduce-length

reproduce-sparsity: $(STAMP)
	$(BIN)/terra-reproduce sparsity --out out/reproduce/sparsity

reproduce-length: $(STAMP)
	$(BIN)/terra-reproduce length_generalization --out out/reproduce/length_generalization

params: $(STAMP)
	$(BIN)/terra-params --all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache out
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
