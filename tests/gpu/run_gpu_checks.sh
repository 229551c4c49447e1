#!/usr/bin/env bash
# The GPU checks in one go, on a bare GPU machine (Python 3.12 with torch + CUDA, Triton and transformers; no
# megatron-core, vLLM or math-verify; no network). Two commands:
#
#   here, where pip works:         bash tests/gpu/run_gpu_checks.sh --prepare .gpu_prep
#   on the GPU machine:            bash tests/gpu/run_gpu_checks.sh --wheels .gpu_prep
#
# --prepare DIR   downloads the Python 3.12 wheels the checks need that the image lacks (megatron-core 0.19.2,
#                 math-verify and its pinned dependencies; their Requires-Dist are checked against the image) and
#                 writes the tiny built-in model into DIR (tests/gpu/prepare.py); prints DIR's size, < 64 MiB.
#                 Runs with $PYTHON [.venv/bin/python when present, else python3], which needs gtpo_megatron's
#                 dependencies (the model is built with gtpo_megatron.builtin_models).
# --wheels DIR    installs DIR's wheels into $GTPO_GPU_SITE [/tmp/gtpo_gpu_site] (pip --no-index --no-deps),
#                 puts them on PYTHONPATH and the model cache at DIR/models, then runs the check groups, each in its
#                 own process with its own time limit (tests/gpu/run_checks.py):
#                   ops       the log-prob op and the losses on CUDA vs float64 CPU references (fp32, bf16, chunked,
#                             padded vocabulary, -inf logits, entropy at a second temperature, gradients), the
#                             chunked op's peak memory vs gtpo-plan's estimate
#                   megatron  TP=1 forward parity with transformers (fp32; bf16 with and without the fp32 output
#                             layer), one training step on NCCL, Transformer Engine specs when TE imports
#                   trainer   a 2-step Trainer.run on NCCL (pure and cpu:gloo,cuda:nccl) with the real policy and a
#                             stand-in rollout engine (real vLLM when installed), every collective recorded
#                   vllm      generation, train/rollout mismatch, weight sync, sleep/wake (only with vLLM)
#                   moe       a random Qwen3-MoE: parity with transformers (fp32, bf16), one NCCL training step
#                 and, with --bench, the benchmarks of docs/performance.md (tests/gpu/test_gpu_bench*.py):
#                   bench     the fused log-prob op vs Megatron's vocab_parallel_cross_entropy and log_softmax
#                             (N=8192, V=151936, bf16, fwd+bwd: time, memory, roofline fraction); the bf16
#                             training step of a random Qwen2.5-1.5B at s=2048 and longer until one does not fit
#                             (tokens/s, MFU, peak memory vs gtpo-plan); the GTPO step's own overhead
#                   bench_lora_moe LoRA (rank 128, all seven projections) against full fine-tuning on the same
#                             model (tokens/s, peak memory vs gtpo-plan), and 2 layers of Qwen3-30B-A3B at EP 1
#                 and prints one summary table, also written to $OUT/summary.txt [OUT: /tmp/gtpo_gpu_checks].
#                 Without --wheels the checks use whatever the interpreter has installed.
# --dry-run       the same pipeline on the CPU (gloo, fp32, smaller sizes); the CUDA-only checks skip with a reason.
# --bench         also run the bench groups (their 300 s are added to the default budget); --only GROUP... runs
#                 only the groups named (e.g. --only bench bench_lora_moe).
# Other arguments go to pytest (e.g. -k trainer). Knobs: PYTHON, OUT, GTPO_GPU_SITE, GPU_CHECK_BUDGET [seconds for
# the groups: 330 on a GPU (560 with --bench, which fits the lent machine's 600 s a command; groups the budget does
# not reach are reported "not run"), 1100 in a dry run; the whole script is killed 30 s later]. Exit status
# 0 when every group finished and no check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON="$(command -v python3 || command -v python)"; fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1:-}" = "--prepare" ]; then
  exec "$PYTHON" -m tests.gpu.prepare "${2:?usage: run_gpu_checks.sh --prepare DIR}"
fi
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      wheels="${2:?usage: run_gpu_checks.sh --wheels DIR}"; shift 2
      site="${GTPO_GPU_SITE:-/tmp/gtpo_gpu_site}"
      "$PYTHON" -m tests.gpu.prepare --install "$site" "$wheels" || exit 2
      export PYTHONPATH="$PYTHONPATH:$site" GTPO_CACHE_DIR="$(cd "$wheels" && pwd)/models" ;;
    *) args+=("$1"); shift ;;
  esac
done
dry_run=0 bench_s=0
for arg in ${args[@]+"${args[@]}"}; do
  [ "$arg" = "--dry-run" ] && dry_run=1
  [ "$arg" = "--bench" ] && bench_s="$("$PYTHON" -c 'from tests.gpu.run_checks import BENCH_BUDGET_S as s; print(s)')"
done
if [ "$dry_run" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_gpu_checks.sh: torch sees no CUDA device; run on a GPU machine, or pass --dry-run" >&2
  exit 2
fi
default_budget=$(( $([ "$dry_run" = 1 ] && echo 1100 || echo 330) + bench_s ))
[ "$dry_run" = 0 ] && [ "$default_budget" -gt 560 ] && default_budget=560
budget="${GPU_CHECK_BUDGET:-$default_budget}"
timeout --kill-after=10 "$((budget + 30))" \
  "$PYTHON" -m tests.gpu.run_checks --out "${OUT:-/tmp/gtpo_gpu_checks}" --budget "$budget" ${args[@]+"${args[@]}"}
