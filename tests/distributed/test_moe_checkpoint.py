"""Dist checkpoints of a mixture-of-experts policy across expert layouts, on 2 gloo ranks.

``builtin:tiny-qwen3-moe`` (8 experts a layer): one step at EP=2 (4 experts a rank), save, then the run continues
two steps; a fresh policy at EP=1 (every rank all 8 experts, DP=2) loads the checkpoint and takes the same two
steps: losses and gradient norms equal the EP=2 run's within fp32 noise, which needs every expert's weights and
Adam moments resharded. Then the reverse (save at EP=1, resume at EP=2). A dense policy is refused the MoE
checkpoint with a ValueError naming the expert counts, before any tensor is read.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_QWEN2, make_batch, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

TINY_MOE = "builtin:tiny-qwen3-moe"
LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.9, clip_eps_high=10.0)
RESHARD_ATOL = 1e-6


def _policy(path: str, ep: int):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import LRSchedule
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=1, pp_size=1, ep_size=ep)
    optim, schedule = OptimConfig(lr=1e-3, clip_grad=1.0), LRSchedule(total_steps=10)
    settings = settings_at(groups, model_section(path), optim=optim, schedule=schedule, seed=7)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _batch(rank: int):
    batch = make_batch(rows=4, seed=5 + rank, vocab_size=1000)
    batch.old_logprobs = torch.full(batch.input_ids.shape, -10.8) * batch.response_mask
    return batch


def _two_steps(policy, rank: int) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in (policy.train_step(_batch(rank), LOSS) for _ in range(2))]


def _worker(rank: int, world_size: int, root: str) -> None:
    for saved_ep, resumed_ep in ((2, 1), (1, 2)):
        folder = f"{root}/ep{saved_ep}/step_000001"
        policy = _policy(TINY_MOE, saved_ep)
        assert policy.train_step(_batch(rank), LOSS)["skipped"] == 0.0
        policy.save_checkpoint(folder, {"step": 1})
        expected = _two_steps(policy, rank)
        resumed = _policy(TINY_MOE, resumed_ep)
        assert resumed.load_checkpoint(folder) == {"step": 1}
        got = _two_steps(resumed, rank)
        for (loss, norm), (loss_ref, norm_ref) in zip(got, expected):
            assert abs(loss - loss_ref) <= RESHARD_ATOL and abs(norm - norm_ref) <= 1e-5 * norm_ref, (got, expected)
        if rank == 0:
            print(f"[moe reshard EP={saved_ep} -> EP={resumed_ep}] steps {got} vs {expected}")
    with pytest.raises(ValueError, match="holds a model with 8 experts a layer .* the policy has 0"):
        _policy(TINY_QWEN2, 1).load_checkpoint(f"{root}/ep2/step_000001")


def test_moe_checkpoint_reshards_between_expert_layouts(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
