#!/usr/bin/env bash
# Checks a recipe for a cluster without GPUs: world-size and divisibility arithmetic (heads, query groups, layers,
# padded vocabulary, batch vs group size vs data parallel, engine TP) and per-GPU memory, via gtpo-plan.
# Usage:  bash launch/dry_run.sh CONFIG GPUS [--gpu-mem 80] [--sync-bandwidth-gbps 400] [key=value overrides...]
# Exit status: 0 when the layout divides and fits, 2 with the reasons when it does not.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${1:?usage: bash launch/dry_run.sh CONFIG GPUS [gtpo-plan options] [key=value overrides...]}"
GPUS="${2:?usage: bash launch/dry_run.sh CONFIG GPUS [gtpo-plan options] [key=value overrides...]}"
shift 2
exec python -m gtpo_megatron.plan_cli --config "$CONFIG" --gpus "$GPUS" "$@"
