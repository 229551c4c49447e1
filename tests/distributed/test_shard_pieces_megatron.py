"""A real Megatron model's own pieces (``MegatronPolicy.shard_pieces``) join into the gathered stream, 2 gloo ranks.

For tiny-qwen2 at TP=2 and PP=2 (also with LoRA adapters, B random: the pieces are the merged weights) and tiny
Qwen3-MoE at EP=2 and TP=2 x EP=2: every rank offers its pieces, the
plan (``rollout/shard_plan.py``) picks the owners, the owners' parts are shared with ``all_gather_object`` (the
wire is ``test_sharded_sync.py``'s), and the tensors joined per the plan must be ``torch.equal`` to those
``iter_hf_weights`` yields (the collective path's stream), with the same names.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.config import LoRAConfig
from tests.adapter.megatron_helpers import TINY_QWEN2, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed


def _build(path: str, tp: int, pp: int, ep: int, lora: LoRAConfig | None = None):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp, ep_size=ep)
    model = model_section(path, make_vocab_size_divisible_by=100, lora=lora or LoRAConfig())
    settings = settings_at(groups, model, sequence_parallel=tp > 1 and ep > 1)
    policy = MegatronPolicy.from_pretrained(settings, groups=groups)
    if lora is not None:  # B starts at zero (merged == base): give every adapter a nonzero B
        generator = torch.Generator().manual_seed(dist.get_rank())
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return policy


def _check(policy, label: str) -> None:
    from gtpo_megatron.rollout.shard_plan import WHOLE, build_shard_plan

    offers, pieces = policy.shard_pieces()
    plan = build_shard_plan(_all(offers), bucket_bytes=2**20, element_size=4)
    me = dist.get_rank()
    owned = {(t.name, p): pieces[(t.name, p)].clone()
             for t in plan.tensors for p, (s, _) in enumerate(t.parts) if plan.senders[s] == me}  # fmt: skip
    shared = {k: v for rank_parts in _all(owned) for k, v in rank_parts.items()}
    joined = {}
    for t in plan.tensors:
        parts = [shared[(t.name, p)] for p in range(len(t.parts))]
        joined[t.name] = parts[0] if t.dim == WHOLE else torch.cat(parts, dim=t.dim)
    expected = dict(policy.iter_hf_weights())
    assert [t.name for t in plan.tensors] and joined.keys() == expected.keys(), label
    for name, tensor in expected.items():
        assert torch.equal(joined[name], tensor), f"{label}: {name}"
    if me == 0:
        print(f"[shard pieces] {label}: {len(plan.tensors)} tensors from {len(plan.senders)} senders, equal")


def _all(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _worker(rank: int, world_size: int, out_root: str) -> None:
    from tests.adapter.megatron_helpers import save_random_hf_model
    from tests.helpers.tiny_configs import tiny_moe

    moe = f"{out_root}/qwen3_moe"
    if rank == 0:
        save_random_hf_model(moe, tiny_moe("qwen3_moe"))
    dist.barrier()
    for tp, pp in ((2, 1), (1, 2)):
        _check(_build(TINY_QWEN2, tp, pp, 1), f"tiny-qwen2 tp={tp} pp={pp}")
        _check(_build(TINY_QWEN2, tp, pp, 1, LoRAConfig(rank=4, alpha=8)), f"tiny-qwen2 LoRA tp={tp} pp={pp}")
    for tp, ep in ((1, 2), (2, 2)):
        _check(_build(moe, tp, 1, ep), f"qwen3_moe tp={tp} ep={ep}")


def test_own_pieces_join_into_the_gathered_stream(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
