"""``lora_gather.gather_adapter_tensors`` on 2 gloo ranks (TP=2, TP=2 with SP, PP=2) against the full adapters.

Random float64 adapters (``tests/helpers/lora_reference.py``, the single-process reference) are sharded by hand
into the Megatron policy of tiny-qwen2 (all seven projections; a masked subset leaves linear_qkv half-adapted);
the gather must give back every one under its PEFT key, on every rank, equal to the reference in fp32, and the
PEFT export writes them.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.config import LoRAConfig
from gtpo_megatron.rollout.peft_adapter import tensor_key
from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model, megatron_named_params, model_section, settings_at
from tests.helpers.dist_harness import run_distributed
from tests.helpers.lora_reference import random_adapters, shard

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
LINEAR = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
          "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
          "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}  # fmt: skip


def _check(tp: int, pp: int, sequence_parallel: bool, projections: tuple[str, ...], out_dir: str) -> None:
    from gtpo_megatron.megatron_adapter.lora_gather import export_adapter, gather_adapter_tensors
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=projections)
    settings = settings_at(groups, model_section(TINY_QWEN2, lora=lora), sequence_parallel=sequence_parallel)
    policy = MegatronPolicy.from_pretrained(settings, groups=groups)
    adapters = random_adapters(load_hf_model(TINY_QWEN2), projections, RANK, seed=tp + 3 * pp)
    params = dict(megatron_named_params(policy))
    with torch.no_grad():
        for (layer, proj), pair in adapters.items():
            for which, tensor in zip("AB", pair):
                name = f"decoder.layers.{layer}.{LINEAR[proj]}_lora.lora_{which}.{proj}"
                if name in params:  # else another pipeline stage's layer
                    params[name].copy_(shard(tensor, proj, which, groups.tp_rank, tp))
    gathered = gather_adapter_tensors(policy.model, groups)
    label = f"tp={tp} pp={pp} sp={sequence_parallel} {projections}"
    expected = {tensor_key(layer, proj, which): tensor.detach().float()
                for (layer, proj), pair in adapters.items() for which, tensor in zip("AB", pair)}  # fmt: skip
    assert sorted(gathered) == sorted(expected), f"{label}: {sorted(set(gathered) ^ set(expected))[:4]}"
    for key, tensor in expected.items():
        assert torch.equal(gathered[key], tensor), f"{label}: {key} differs"
    export_adapter(policy, out_dir, lora, base_model=TINY_QWEN2)
    if groups.rank == 0:
        from safetensors.torch import load_file

        written = load_file(f"{out_dir}/adapter_model.safetensors")
        assert all(torch.equal(written[key], tensor) for key, tensor in expected.items()), label
    print(f"[lora gather] {label}: {len(gathered)} tensors equal the reference")


def _worker(rank: int, world_size: int, root: str) -> None:
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for index, (tp, pp, sequence_parallel, projections) in enumerate(
        ((2, 1, False, all_linear), (2, 1, True, ("q_proj", "v_proj", "down_proj")), (1, 2, False, all_linear))
    ):
        _check(tp, pp, sequence_parallel, projections, f"{root}/export-{index}")


def test_gathered_adapters_equal_the_full_reference(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
