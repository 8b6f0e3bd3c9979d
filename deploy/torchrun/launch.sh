#!/usr/bin/env bash
# Elastic multi-node torchrun on spot VMs with spotguard. Run on EVERY training
# node (same command on each):
#
#   SPOTGUARD_STORAGE=s3://my-bucket/runs/r42 RDZV_HOST=10.0.0.5 \
#     deploy/torchrun/launch.sh examples/torchrun_train.py --steps 1000
#
# RDZV_HOST must be a STABLE machine (an on-demand VM, not a spot one) running
# deploy/torchrun/rendezvous-store.sh: if the rendezvous store lived on a spot
# node, its preemption would take the whole job down. Nodes join and leave
# between NNODES_MIN and NNODES_MAX; after a preemption the survivors
# re-rendezvous (up to MAX_RESTARTS times) and resume from the newest committed
# checkpoint.
set -euo pipefail

: "${SPOTGUARD_STORAGE:?set SPOTGUARD_STORAGE (s3://, gs://, az:// or a shared path)}"
: "${RDZV_HOST:?set RDZV_HOST to the stable node running rendezvous-store.sh}"
RDZV_PORT="${RDZV_PORT:-29400}"
RDZV_ID="${RDZV_ID:-spotguard-job}"
NNODES_MIN="${NNODES_MIN:-1}"
NNODES_MAX="${NNODES_MAX:-4}"
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
MAX_RESTARTS="${MAX_RESTARTS:-100}"
# Extra rendezvous settings, e.g. RDZV_CONF=last_call_timeout=10 (how long a round that has
# NNODES_MIN nodes waits for more before it starts; torchrun's default is 30 s).
RDZV_CONF="${RDZV_CONF:-}"
export SPOTGUARD_STORAGE
# torch 2.13's c10d rendezvous shares its TCPStore and caches the bootstrap info of the
# first round: when a node joins a running job and the old rank-0 agent stays rank 0, that
# agent never publishes MASTER_ADDR for the new round and the joining node waits for it
# until it times out (tests/hook/test_elastic_recipe.py). Not sharing the store avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
export SPOTGUARD_SOCKET="${SPOTGUARD_SOCKET:-/run/spotguard/spotguard.sock}"
# The hook's SIGTERM path: torchrun SIGKILLs its workers 30 s after its own SIGTERM.
export SPOTGUARD_SIGNAL_GRACE="${SPOTGUARD_SIGNAL_GRACE:-30}"

if [ "$#" -lt 1 ]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]" >&2
  exit 2
fi

# Use the node's daemon (systemd/spotguard.service) when it answers; otherwise
# run one for this job, with its socket in a directory we can write.
daemon_pid=""
if ! spotguard status --socket "${SPOTGUARD_SOCKET}" --timeout 2 > /dev/null 2>&1; then
  run_dir="${XDG_RUNTIME_DIR:-${HOME}/.spotguard}"
  mkdir -p "${run_dir}"
  export SPOTGUARD_SOCKET="${run_dir}/spotguard.sock"
  spotguard daemon --socket "${SPOTGUARD_SOCKET}" >> "${run_dir}/daemon.log" 2>&1 &
  daemon_pid=$!
  trap 'if [ -n "${daemon_pid}" ]; then kill "${daemon_pid}" 2> /dev/null || true; fi' EXIT
  for _ in $(seq 1 30); do
    if spotguard status --socket "${SPOTGUARD_SOCKET}" --timeout 1 > /dev/null 2>&1; then break; fi
    sleep 1
  done
fi
spotguard status --socket "${SPOTGUARD_SOCKET}" --timeout 5
# Blind to notices (metadata unreachable, a 404-only metadata server)? Say so, train anyway:
# the hook still acts on SIGTERM.
if ! spotguard status --check --socket "${SPOTGUARD_SOCKET}" --timeout 5; then
  echo "WARNING: the spotguard daemon cannot see termination notices (see above); training with SIGTERM handling only" >&2
fi

# Not `exec`: the trap above must stop the job's own daemon after torchrun.
torchrun \
  --nnodes="${NNODES_MIN}:${NNODES_MAX}" \
  --nproc-per-node="${NPROC_PER_NODE}" \
  --max-restarts="${MAX_RESTARTS}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${RDZV_HOST}:${RDZV_PORT}" \
  --rdzv-id="${RDZV_ID}" \
  --rdzv-conf="is_host=false${RDZV_CONF:+,${RDZV_CONF}}" \
  "$@"
