"""The LR convention of ``optimizer.py``: update k trains at lr(k-1); warm-up ramps ``lr * k / (W + 1)``.

Hand-computed (lr 1e-3, cosine to 0 over N steps after W warm-up steps: ``5e-4 (1 + cos(pi (n - W) / (N - W)))``).
Megatron's scheduler runs over a fake optimizer that records the lr of each update.
"""

from __future__ import annotations

import math
import warnings

import pytest

from gtpo_megatron.config import ModelConfig, OptimConfig
from gtpo_megatron.megatron_adapter.optimizer import optimizer_step, restore_schedule, scheduler_kwargs
from gtpo_megatron.megatron_adapter.settings import LRSchedule, PolicySettings


class _Optimizer:
    """The calls ``optimizer_step`` makes; ``applied`` holds the lr of each applied update."""

    def __init__(self, lr: float, min_lr: float) -> None:
        self.param_groups = [{"lr": 0.0, "max_lr": lr, "min_lr": min_lr}]
        self.applied: list[float] = []
        self.norm = 1.0

    def prepare_grads(self) -> None:
        pass

    def get_grad_norm(self) -> float:
        return self.norm

    def step(self) -> None:
        self.applied.append(self.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        pass

    def zero_grad_buffer(self) -> None:
        pass


def _scheduler(*, total_steps: int, decay_style: str, **optim):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    settings = PolicySettings(model=ModelConfig(name_or_path="x"), optim=OptimConfig(**{"lr": 1e-3, **optim}),
                              schedule=LRSchedule(total_steps=total_steps, decay_style=decay_style))  # fmt: skip
    optimizer = _Optimizer(settings.optim.lr, settings.optim.min_lr)
    return OptimizerParamScheduler(optimizer, **scheduler_kwargs(settings))


def _train(scheduler, updates: int) -> list[float]:
    reported = [optimizer_step(scheduler.optimizer, scheduler, scheduler.optimizer)["lr"] for _ in range(updates)]
    assert reported == scheduler.optimizer.applied[-updates:]  # the logged lr is the one the update used
    return reported


@pytest.mark.parametrize(
    ("optim", "expected"),
    [
        (dict(total_steps=2, decay_style="cosine"), [1e-3, 5e-4]),
        (dict(total_steps=4, decay_style="cosine"), [1e-3, 8.535533905932737e-4, 5e-4, 1.4644660940672627e-4]),
        (dict(total_steps=3, warmup_steps=1, decay_style="cosine"), [5e-4, 1e-3, 5e-4]),
        (dict(total_steps=5, warmup_steps=3, decay_style="constant"), [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]),
        (dict(total_steps=3, decay_style="linear", min_lr=1e-4), [1e-3, 7e-4, 4e-4]),
    ],
)
def test_update_k_trains_at_lr_of_k_minus_1(optim, expected):
    assert _train(_scheduler(**optim), len(expected)) == pytest.approx(expected, rel=1e-12)


def test_skipped_update_does_not_advance_the_schedule():
    scheduler = _scheduler(total_steps=4, decay_style="cosine")
    scheduler.optimizer.norm = math.inf
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert optimizer_step(scheduler.optimizer, scheduler, scheduler.optimizer)["skipped"] == 1.0
    scheduler.optimizer.norm = 1.0
    assert _train(scheduler, 2) == pytest.approx([1e-3, 8.535533905932737e-4], rel=1e-12)


def test_restore_applies_the_config_schedule_at_the_checkpoint_position(caplog):
    first = _scheduler(total_steps=2, decay_style="cosine")
    _train(first, 2)
    saved = first.state_dict()
    extended = _scheduler(lr=2e-3, total_steps=4, decay_style="cosine")
    extended.optimizer.param_groups[0].update(max_lr=1e-3)  # what a loaded optimizer state brings back
    with caplog.at_level("WARNING"):
        changed = restore_schedule(extended, saved)
    assert changed == {"max_lr": (1e-3, 2e-3), "lr_decay_steps": (2, 4)}
    assert "max_lr 0.001 -> 0.002, lr_decay_steps 2 -> 4" in caplog.text
    assert _train(extended, 2) == pytest.approx([1e-3, 2.9289321881345254e-4], rel=1e-12)
    same = _scheduler(lr=2e-3, total_steps=4, decay_style="cosine")
    assert restore_schedule(same, extended.state_dict()) == {}
