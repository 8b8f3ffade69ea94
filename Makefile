# terra: `make run` and `make test` set up .venv on first use (pinned requirements plus the
# package in editable mode) and reuse it afterwards; a changed requirements.txt, setup.cfg
# or pyproject.toml triggers a reinstall.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.terra-installed
# Keep JAX on the CPU and quiet TensorFlow's start-up logging.
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: run test bench bench-input bench-train params reproduce reproduce-sparsity reproduce-length clean install

install: $(STAMP)

$(STAMP): requirements.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check --quiet --upgrade pip
	$(PY) -m pip install --disable-pip-version-check --quiet -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check --quiet --no-deps -e .
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m terra.quickstart

# Two workers: most of the suite's time is single-threaded XLA compilation.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests

bench: $(STAMP)
	$(PY) -m terra.benchmarks.decode_speed --preset paper_800m --out out/decode_speed

bench-input: $(STAMP)
	$(PY) -m terra.benchmarks.input_pipeline --out out/input_pipeline

bench-train: $(STAMP)
	$(PY) -m terra.benchmarks.train_speed --out out/train_speed

# The paper's claims at CPU size (README "Reproducing the paper"): about 45 + 30 minutes on 2 cores.
reproduce: reproduce-sparsity reproduce-length

reproduce-sparsity: $(STAMP)
	$(PY) -m terra.reproduce sparsity --out out/reproduce/sparsity

reproduce-length: $(STAMP)
	$(PY) -m terra.reproduce length_generalization --out out/reproduce/length_generalization

params: $(STAMP)
	$(PY) -m terra.benchmarks.param_count --all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache out
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
