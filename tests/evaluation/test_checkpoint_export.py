"""Megatron checkpoint of a run -> HF folder (``evaluation.checkpoint_export``, ``gtpo-eval --model CKPT``).

Like the trainer does: two gloo ranks (TP=2, a layout different from the exporter's TP=1) build the policy of
``builtin:tiny-llama`` from a run config, take one optimizer step (so the weights differ from the base model),
save ``RUN_DIR/checkpoints/step_000001`` (+ ``latest``) and record ``policy.iter_hf_weights()``. A fresh
process then resolves the *run dir* through ``resolve_hf_model`` (the path ``gtpo-eval`` takes): the exported
safetensors must equal the recorded weights bit for bit, transformers must load the folder, and a second
resolution must reuse the folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.adapter.megatron_helpers import TINY_LLAMA
from tests.helpers.dist_harness import run_distributed
from tests.helpers.run_checkpoints import train_and_save

pytestmark = pytest.mark.distributed


def _train_and_save(rank: int, world_size: int, run_dir: str) -> None:
    policy = train_and_save(rank, run_dir, TINY_LLAMA)
    weights = {name: tensor.clone() for name, tensor in policy.iter_hf_weights()}
    if rank == 0:
        torch.save(weights, Path(run_dir) / "expected_hf_weights.pt")


def _resolve_in_fresh_process(model: str) -> str:
    """``resolve_hf_model`` under gtpo-eval's console: an export says what it does, not Megatron's internals."""
    code = (
        "import sys; from gtpo_megatron.evaluation.cli import setup_console; setup_console(); "
        "from gtpo_megatron.evaluation.evaluate import resolve_hf_model; print(resolve_hf_model(sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, model],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "INFO] exporting" in out.stderr
    for internal in ("Params for bucket", "LR schedule", "RNG states are not restored", "Apex"):
        assert internal not in out.stderr, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_export_run_checkpoint_to_hf(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.evaluation.evaluate import resolve_hf_model

    run_dir = tmp_path / "run"
    run_distributed(_train_and_save, 2, str(run_dir))
    step_dir = run_dir / "checkpoints" / "step_000001"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000001"

    hf_dir = Path(_resolve_in_fresh_process(str(run_dir)))
    assert hf_dir == step_dir / "hf"
    expected = torch.load(run_dir / "expected_hf_weights.pt")
    exported = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        exported.update(load_file(str(file)))
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    base = load_file(str(Path(resolve_model_path(TINY_LLAMA)) / "model.safetensors"))
    assert not torch.equal(
        base["model.layers.0.mlp.down_proj.weight"], exported["model.layers.0.mlp.down_proj.weight"]
    ), "the step did not change the weights"

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()

    stamp = (hf_dir / "config.json").stat().st_mtime_ns
    assert resolve_hf_model(str(step_dir)) == str(hf_dir)  # step folder: the cached export is reused
    assert resolve_hf_model(str(run_dir / "checkpoints")) == str(hf_dir)
    assert (hf_dir / "config.json").stat().st_mtime_ns == stamp
