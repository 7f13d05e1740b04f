#!/usr/bin/env bash
# Starts NUM_PROCESSES copies of a command on this machine as one multi-process JAX run on CPU,
# connected through a coordinator on 127.0.0.1 (what the multi-host tests use; also a way to try
# a multi-host configuration without a cluster).
#
# Usage:
#   NUM_PROCESSES=2 DEVICES_PER_PROCESS=2 launch/local_multiprocess.sh \
#     python -m sonew_pax.train --gin_file=tiny.gin --gin.MODEL_DIR=\"/tmp/tiny_mp\"
#
# Variables:
#   NUM_PROCESSES          (required) how many processes to start.
#   DEVICES_PER_PROCESS    simulated CPU devices per process (default 1).
#   COORDINATOR_PORT       port of the coordinator on 127.0.0.1 (default: a free port).
#   DISTRIBUTED_TIMEOUT_S  seconds every process waits for the others to join (default 60).
#   LOG_DIR                if set, process i writes to LOG_DIR/process_i.log; otherwise all
#                          output goes to stdout, each line prefixed with "[process i]".
#   PYTHON                 the interpreter used to find a free port (default: python3).
#
# Each process gets JAX_PLATFORMS=cpu, --xla_force_host_platform_device_count=N added to XLA_FLAGS, and
# COORDINATOR_ADDRESS, PROCESS_COUNT, PROCESS_INDEX (read by sonew_pax.distributed). The script
# exits with the first non-zero status of any process (stopping the others), or 0.
set -euo pipefail

die() {
  echo "local_multiprocess.sh: error: $*" >&2
  exit 2
}

require() {
  # require NAME DESCRIPTION: fails unless the variable NAME is set and non-empty.
  [[ -n "${!1:-}" ]] || die "$1 is not set: $2 (see the header of launch/local_multiprocess.sh)"
}

free_port() {
  "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

require NUM_PROCESSES "the number of processes to start"
[[ "$NUM_PROCESSES" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES must be a positive integer, got '$NUM_PROCESSES'"
[[ $# -gt 0 ]] || die "no command given; usage: NUM_PROCESSES=2 $0 python -m sonew_pax.train ..."
DEVICES_PER_PROCESS="${DEVICES_PER_PROCESS:-1}"
COORDINATOR_PORT="${COORDINATOR_PORT:-$(free_port)}"
DISTRIBUTED_TIMEOUT_S="${DISTRIBUTED_TIMEOUT_S:-60}"

pids=()
stop_all() {
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}
trap 'stop_all' INT TERM

for ((i = 0; i < NUM_PROCESSES; i++)); do
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}"
  export COORDINATOR_ADDRESS="127.0.0.1:${COORDINATOR_PORT}"
  export PROCESS_COUNT="$NUM_PROCESSES" PROCESS_INDEX="$i"
  export DISTRIBUTED_TIMEOUT_S
  if [[ -n "${LOG_DIR:-}" ]]; then
    mkdir -p "$LOG_DIR"
    "$@" >"$LOG_DIR/process_$i.log" 2>&1 &
  else
    "$@" > >(sed -u "s/^/[process $i] /") 2>&1 &
  fi
  pids+=("$!")
done

status=0
for ((n = 0; n < NUM_PROCESSES; n++)); do
  wait -n "${pids[@]}" || status=$?
  if [[ $status -ne 0 ]]; then
    echo "local_multiprocess.sh: a process exited with status $status; stopping the others" >&2
    stop_all
    wait || true
    exit "$status"
  fi
done
