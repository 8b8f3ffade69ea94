#!/usr/bin/env bash
# Start N terra-train processes on this machine as one multi-host job: JAX's distributed runtime
# (jax.distributed, coordinator on localhost) with CPU collectives over gloo, each process
# feeding its own shard of the data. Shows on one machine what a multi-host run does.
#
#   scripts/launch_local_multihost.sh 2 --gin_file=experiments/quickstart.gin \
#       --gin.MODEL_DIR="'runs/multihost'"
#
# Each process sees the devices XLA gives it (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=K).
# Process 0 prints to this terminal; the others log to $TERRA_LOG_DIR/process-<i>.log
# (default: a temporary directory, printed at start).
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 N_PROCESSES [terra-train flags...]" >&2
  exit 2
fi
N=$1
shift
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
PORT=${TERRA_PORT:-$((20000 + RANDOM % 20000))}
LOG_DIR=${TERRA_LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
echo "launching $N processes, coordinator localhost:$PORT, logs of processes 1..$((N - 1)) in $LOG_DIR" >&2

pids=()
for ((i = 0; i < N; i++)); do
  if [[ $i -eq 0 ]]; then
    TERRA_COORDINATOR=localhost:$PORT TERRA_NUM_PROCESSES=$N TERRA_PROCESS_ID=$i \
      "$PYTHON" -m terra.cli.train "$@" &
  else
    TERRA_COORDINATOR=localhost:$PORT TERRA_NUM_PROCESSES=$N TERRA_PROCESS_ID=$i \
      "$PYTHON" -m terra.cli.train "$@" > "$LOG_DIR/process-$i.log" 2>&1 &
  fi
  pids+=($!)
done

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "process $i failed (see $LOG_DIR/process-$i.log)" >&2
    status=1
  fi
done
exit $status
