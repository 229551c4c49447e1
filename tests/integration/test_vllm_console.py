"""vLLM's console: quiet by default, everything with ``verbose=True``.

One script, run twice in a fresh process: a multiprocess ``VLLMEngine`` on ``builtin:tiny-llama`` (tied
embeddings, a float32 checkpoint served in bfloat16), one weight update, one generation. The whole console of the
caller and of vLLM's engine and worker processes is captured. Quiet: none of vLLM's INFO lines and none of the
warnings listed as harmless in ``rollout/vllm_logging.py`` (the 120 dtype lines, the tied head's "Failed to load
weights" at the update, the eager/Triton/chunked-prefill notes), one line of ours explaining the tied head.
Verbose: those lines are there, which shows that the quiet run hides them rather than that this vLLM stopped
printing them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two multiprocess engine starts: ~1 min idle

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging, sys
from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.vllm_engine import VLLMEngine
from safetensors.torch import load_file

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="OURS %(message)s")
    path = resolve_model_path("builtin:tiny-llama")
    settings = EngineSettings(dtype="bfloat16", max_model_len=64, max_num_seqs=4, verbose=sys.argv[1] == "1")
    with VLLMEngine(path, settings) as engine:
        push_weights(engine, load_file(f"{path}/model.safetensors").items(), bucket_bytes=2**22)
        engine.generate([[1, 2, 3]], 2, SamplingConfig(temperature=1.0, max_tokens=4, seed=0))
    print("SCRIPT DONE")
"""
HIDDEN = ("Attempted to load weight", "ParallelLMHead: Failed to load weights", "Enforce eager set")


def _console(tmp_path: Path, verbose: bool) -> list[str]:
    script = tmp_path / "engine_console.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), "1" if verbose else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0 and "SCRIPT DONE" in lines, "\n".join(lines[-40:])
    return lines


def test_vllm_console_is_quiet_unless_verbose(tmp_path):
    quiet, verbose = _console(tmp_path, verbose=False), _console(tmp_path, verbose=True)
    for text in HIDDEN:
        assert any(text in line for line in verbose), f"vLLM no longer prints {text!r}: update the test"
        assert not any(text in line for line in quiet if not line.startswith("OURS")), "\n".join(quiet)
    assert sum(" INFO " in line for line in verbose) > 10
    assert not any(" INFO " in line and "pid=" in line for line in quiet)  # vLLM's INFO lines carry a pid
    assert any(line.startswith("OURS tied embeddings: vLLM reloads the LM head") for line in quiet)
    print(f"[vllm console] quiet {len(quiet)} lines, verbose {len(verbose)} lines")
    assert len(quiet) * 5 < len(verbose)
