#!/usr/bin/env bash
# GTPO training on one node: torchrun starts NGPU ranks of `python -m gtpo_megatron.train --config CONFIG "$@"`.
# Usage:  [NGPU=8] [CONFIG=configs/X.yaml] bash launch/run_local.sh [key=value overrides...]
# Environment knobs [default]:
#   NGPU         ranks on this node [GPUs listed by nvidia-smi; 2 CPU ranks when there is none]
#   CONFIG       recipe [configs/cpu_demo.yaml]; every training setting lives there or in a key=value override
#   MASTER_PORT  rendezvous port on 127.0.0.1 [29500]
#   LOG_DIR      per-rank logs: LOG_DIR/<run id>/attempt_0/<rank>/{stdout,stderr}.log [logs/<recipe>_<date>]
#   LOG_RANK     local ranks echoed to the console, e.g. 0 or 0,3 [0]
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for its ranks after forwarding a stop signal before SIGKILL [270]
#   GTPO_CPU_PRELOAD  0: the CPU engine's process does not preload Intel OpenMP / tcmalloc, which vLLM asks for
#                 (gtpo_megatron/rollout/cpu_preload.py; 3.2x faster CPU rollouts here) [1]
# `kill -USR1 <torchrun pid>` makes the ranks save at the next step boundary and stop (torchrun forwards it and
# gives them SHUTDOWN_TIMEOUT: more than one step plus one checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${CONFIG:-configs/cpu_demo.yaml}"
NGPU_FOUND=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [ -z "${NGPU:-}" ]; then
  NGPU=$NGPU_FOUND
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_DIR="${LOG_DIR:-logs/$(basename "$CONFIG" .yaml)_$(date +%Y%m%d_%H%M%S)}"
LOG_RANK="${LOG_RANK:-0}"
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-270}"
mkdir -p "$LOG_DIR"
echo "run_local.sh: $NGPU ranks, config $CONFIG, per-rank logs under $LOG_DIR" >&2
exec torchrun --nnodes=1 --nproc-per-node="$NGPU" --master-addr=127.0.0.1 --master-port="$MASTER_PORT" \
  --log-dir="$LOG_DIR" --tee=3 --local-ranks-filter="$LOG_RANK" \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout="$SHUTDOWN_TIMEOUT" \
  -m gtpo_megatron.train --config "$CONFIG" "$@"
