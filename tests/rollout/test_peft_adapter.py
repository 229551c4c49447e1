"""The PEFT adapter folder (``rollout/peft_adapter.py``) against Hugging Face peft's own loader, in float64.

Random adapters on all seven projections of tiny-qwen2 (rank 4, alpha 8), written by ``write_adapter_folder``:
``peft.PeftModel.from_pretrained`` of the folder on the base model gives the logits of the hand-merged weights
``W + alpha / rank * B @ A`` (``tests/helpers/lora_reference.py``), which differ from the base model's.
"""

from __future__ import annotations

import json

import pytest
import torch

from gtpo_megatron.rollout.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterSpec,
    folder_bytes,
    tensor_key,
    write_adapter_folder,
)
from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model
from tests.helpers.lora_reference import merged_hf_weights, random_adapters

RANK, ALPHA = 4, 8.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def _folder_of(adapters, path, projections=ALL):
    tensors = {}
    for (layer, proj), (a, b) in adapters.items():
        tensors[tensor_key(layer, proj, "A")] = a.detach()
        tensors[tensor_key(layer, proj, "B")] = b.detach()
    spec = AdapterSpec(rank=RANK, alpha=ALPHA, projections=projections, base_model="tiny")
    return write_adapter_folder(path, tensors, spec), tensors


def test_peft_loads_the_folder_as_the_merged_weights(tmp_path):
    peft = pytest.importorskip("peft")
    base = load_hf_model(TINY_QWEN2).double()
    adapters = random_adapters(base, ALL, RANK, seed=1)
    folder, tensors = _folder_of(adapters, tmp_path / "adapter")
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert folder_bytes(tensors) == sum(t.numel() * 8 for t in tensors.values())
    with torch.no_grad():
        base_logits = base(IDS).logits
        merged = load_hf_model(TINY_QWEN2).double()
        merged.load_state_dict(merged_hf_weights(base, adapters, ALPHA / RANK), strict=False)
        merged_logits = merged(IDS).logits
        peft_model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
        peft_logits = peft_model(IDS).logits
    assert peft_model.peft_config["default"].r == RANK and peft_model.peft_config["default"].lora_alpha == ALPHA
    diff = (peft_logits - merged_logits).abs().max().item()
    assert diff < 1e-10, diff
    assert (peft_logits - base_logits).abs().max().item() > 1e-3  # the adapters are applied


def test_rewrite_replaces_the_folder_and_bad_keys_are_refused(tmp_path):
    base = load_hf_model(TINY_QWEN2)
    first, _ = _folder_of(random_adapters(base, ("q_proj",), RANK, seed=1), tmp_path / "a", ("q_proj",))
    second, tensors = _folder_of(random_adapters(base, ("v_proj",), RANK, seed=2), tmp_path / "a", ("v_proj",))
    assert first == second and json.loads((second / CONFIG_FILE).read_text())["target_modules"] == ["v_proj"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary sibling left
    from safetensors.torch import load_file

    assert sorted(load_file(second / WEIGHTS_FILE)) == sorted(tensors)
    assert tensor_key(3, "up_proj", "B") == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"
    with pytest.raises(ValueError, match="not PEFT keys"):
        write_adapter_folder(tmp_path / "b", {"model.layers.0.q_proj.weight": torch.zeros(1)}, AdapterSpec(
            rank=1, alpha=1, projections=("q_proj",)))  # fmt: skip
