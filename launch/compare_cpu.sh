#!/usr/bin/env bash
# The seeded small-scale comparison (configs/compare_cpu.yaml; docs/results.md): GRPO (beta = 0), DAPO and GTPO with
# SEEDS seeds each, plus GTPO with its entropy filter acting (gtpo-filter: algorithm.entropy_filter=fixed drops the
# completions with <H>_i > tau = ln 2; the `paper` rule keeps them all here, as <H>_ini ~0.74 > ln 2), one run after
# the other on 2 CPU ranks through launch/run_local.sh (its torchrun line), seed by seed;
# then gtpo-compare (per step: the seed mean and a min-max band).
# Usage:  bash launch/compare_cpu.sh [key=value overrides for every run, e.g. trainer.max_steps=1]
# Smoke test (one step of the filtering run, then the figure):
#   METHODS= SEEDS=0 OUT=runs/compare_smoke bash launch/compare_cpu.sh trainer.max_steps=1
# Environment knobs [default]:
#   OUT           folder of the runs (OUT/<method>/seed<S>) and of the comparison [runs/compare]
#   METHODS       the algorithms run with every seed of SEEDS [grpo dapo gtpo]
#   SEEDS         their seeds: trainer, sampling and prompt order [0 1]
#   FILTER_SEEDS  seeds of the filtering GTPO run [0]
#   MASTER_PORT   rendezvous port on 127.0.0.1 [29500]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/compare}"
METHODS="${METHODS-grpo dapo gtpo}"
SEEDS="${SEEDS:-0 1}"
FILTER_SEEDS="${FILTER_SEEDS-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
overrides=("$@")
runs=()
train() {  # METHOD SEED OVERRIDE...: one run into OUT/METHOD/seedSEED
  local dir="$OUT/$1/seed$2" seed="$2"
  shift 2
  echo "compare_cpu.sh: $dir" >&2
  NGPU=2 CONFIG=configs/compare_cpu.yaml MASTER_PORT="$MASTER_PORT" LOG_DIR="$dir/logs" bash launch/run_local.sh \
    "$@" "trainer.seed=$seed" "rollout.seed=$seed" "data.shuffle_seed=$seed" "output_dir=$dir" "${overrides[@]}"
  runs+=("$dir")
}
for seed in $SEEDS; do
  for algorithm in $METHODS; do train "$algorithm" "$seed" "algorithm=$algorithm"; done
done
for seed in $FILTER_SEEDS; do train gtpo-filter "$seed" algorithm=gtpo algorithm.entropy_filter=fixed; done
python -m gtpo_megatron.evaluation.compare "${runs[@]}" --output "$OUT"
