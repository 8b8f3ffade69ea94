#!/usr/bin/env bash
# The accelerator check: on whatever accelerator JAX sees (one chip), the dense and fully sparse
# 800M models' train step in bfloat16 (tokens/s, MFU against the chip's peak) and batch-1 decode,
# under an 8-minute limit. Prints a table; writes accelerator_check.{json,md} to OUT_DIR (the JSON
# after every measurement, so a run the limit stops keeps what it measured).
#
#   scripts/accelerator_check.sh out/accelerator
#   TERRA_ACCELERATOR_CHECK_SMOKE=1 scripts/accelerator_check.sh /tmp/check   # smallest sizes, any CPU
#
# Needs jax (with the accelerator's plugin), flax, optax, orbax, gin and ml-collections; no
# TensorFlow. PYTHON picks the interpreter (default: the repository's .venv, else python3);
# TERRA_ACCELERATOR_CHECK_SECONDS changes the limit (default 480).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
# Compiling the 800M steps is most of the time: a rerun on the same host reuses the compilations.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/terra-jax-cache}
args=(accelerator --out "$1")
if [[ "${TERRA_ACCELERATOR_CHECK_SMOKE:-0}" == 1 ]]; then
  args+=(--smoke)
fi
exec timeout --signal=TERM --kill-after=10 "${TERRA_ACCELERATOR_CHECK_SECONDS:-480}" \
  "$PYTHON" -m terra.cli.bench "${args[@]}"
