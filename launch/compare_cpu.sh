#!/usr/bin/env bash
# The small-scale comparison (configs/compare_cpu.yaml): GRPO (beta = 0), DAPO and GTPO, same seed, one after the
# other on 2 CPU ranks, then gtpo-compare (accuracy, mean entropy, format rate, filtered fraction, ... side by side).
# Usage:  bash launch/compare_cpu.sh [key=value overrides for all three runs, e.g. trainer.max_steps=2]
# Environment knobs [default]:
#   OUT          folder of the three runs and the comparison [runs/compare]
#   MASTER_PORT  rendezvous port on 127.0.0.1 [29500]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/compare}"
MASTER_PORT="${MASTER_PORT:-29500}"
for algorithm in grpo dapo gtpo; do
  echo "compare_cpu.sh: $algorithm -> $OUT/$algorithm" >&2
  torchrun --nnodes=1 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$MASTER_PORT" \
    -m gtpo_megatron.train --config configs/compare_cpu.yaml "algorithm=$algorithm" "output_dir=$OUT/$algorithm" "$@"
done
python -m gtpo_megatron.evaluation.compare "$OUT/grpo" "$OUT/dapo" "$OUT/gtpo" --output "$OUT"
