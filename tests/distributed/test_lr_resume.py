"""The LR of every update of a resumed run: the config's schedule applies, at the checkpoint's position.

Tiny model, lr 1e-3, cosine to 0 (update k uses lr(k-1), ``optimizer.py``): ``lr(n) = 5e-4 (1 + cos(pi n / N))``.
An uninterrupted 4-step run trains at ``[1e-3, 8.535534e-4, 5e-4, 1.464466e-4]``; a 2-step run, saved and
resumed with 4 steps, trains its steps 3 and 4 at the same values as the uninterrupted run, and a resume with
``lr=2e-3`` at twice those.
"""

from __future__ import annotations

import math

import pytest

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_QWEN2, make_batch, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.28)
UNINTERRUPTED = [1e-3, 8.535533905932737e-4, 5e-4, 1.4644660940672627e-4]


def _policy(groups, *, lr: float, total_steps: int):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import LRSchedule

    optim, schedule = OptimConfig(lr=lr, clip_grad=1.0), LRSchedule(total_steps=total_steps, decay_style="cosine")
    settings = settings_at(groups, model_section(TINY_QWEN2), optim=optim, schedule=schedule)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _lrs(policy, steps: int) -> list[float]:
    batch = make_batch(rows=2, seed=3)
    batch.old_logprobs = batch.response_mask * -10.8
    return [policy.train_step(batch, LOSS)["lr"] for _ in range(steps)]


def _runs(rank: int, world_size: int, root: str) -> None:
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=1, pp_size=1)
    uninterrupted = _lrs(_policy(groups, lr=1e-3, total_steps=4), 4)
    first = _policy(groups, lr=1e-3, total_steps=2)
    before = _lrs(first, 2)
    first.save_checkpoint(f"{root}/step_000002", {"step": 2})
    extended = _policy(groups, lr=1e-3, total_steps=4)
    extended.load_checkpoint(root)
    after = _lrs(extended, 2)
    higher = _policy(groups, lr=2e-3, total_steps=4)
    higher.load_checkpoint(root)
    after_higher = _lrs(higher, 2)
    print(f"[lr] uninterrupted {uninterrupted}; 2 steps {before} + resumed {after}; lr=2e-3 resumed {after_higher}")
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(uninterrupted, UNINTERRUPTED)), uninterrupted
    assert before == pytest.approx([1e-3, 5e-4], rel=1e-12)
    assert after == pytest.approx(UNINTERRUPTED[2:], rel=1e-12)
    assert after_higher == pytest.approx([2 * lr for lr in UNINTERRUPTED[2:]], rel=1e-12)


def test_resumed_run_follows_the_config_schedule(tmp_path):
    run_distributed(_runs, 1, str(tmp_path / "checkpoints"))
