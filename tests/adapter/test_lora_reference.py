"""The hand-written float64 LoRA of the parity tests (``tests/helpers/lora_reference.py``) against Hugging Face peft.

The same adapters copied into ``peft.get_peft_model`` (rank 4, alpha 8, all seven projections or a subset) give
the same logits (float64, atol 1e-10) and peft's ``merge_and_unload`` the same merged weights: the reference the
Megatron adapters are checked against is peft's formula. Skipped without peft (the ``dev`` extra installs it).
"""

from __future__ import annotations

import pytest
import torch

from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model
from tests.helpers.lora_reference import PARENT, add_lora, merged_hf_weights, random_adapters

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("projections", [tuple(PARENT), ("q_proj", "v_proj", "down_proj")])
def test_hand_written_lora_is_peft(projections):
    hf_model = load_hf_model(TINY_QWEN2).double()
    adapters = random_adapters(hf_model, projections, 4, seed=1)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    handles = add_lora(hf_model, adapters, 8 / 4)
    with torch.no_grad():
        expected = hf_model(ids).logits
    merged = merged_hf_weights(hf_model, adapters, 8 / 4)
    for handle in handles:
        handle.remove()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(projections), lora_dropout=0.0)
    peft_model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():
        for (index, proj), (a, b) in adapters.items():
            linear = getattr(getattr(peft_model.base_model.model.model.layers[index], PARENT[proj]), proj)
            linear.lora_A["default"].weight.copy_(a)
            linear.lora_B["default"].weight.copy_(b)
        torch.testing.assert_close(peft_model(ids).logits, expected, atol=1e-10, rtol=0)
        state = peft_model.merge_and_unload().state_dict()
    for name, weight in merged.items():
        torch.testing.assert_close(state[name], weight, atol=1e-12, rtol=0)
