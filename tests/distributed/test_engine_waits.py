"""Two gloo ranks, rank 0 leading the one engine, rank 1 waiting for its batch in the world group's collectives.

The world group's timeout is ``GTPOConfig.world_timeout_s`` with its margin scaled from 30 minutes to
``MARGIN_S``, and ``rollout.timeout_s`` is set above that former fixed limit (scaled: ``OLD_LIMIT_S``): an engine
slower than the old limit but within ``rollout.timeout_s`` times nothing out (sync round, async take and drain of
``max_staleness`` batches); an engine past it stops both ranks with an error naming the engine and the setting,
never with gloo's "Timed out waiting". Times are bounds, never asserted.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from gtpo_megatron.config import load_config
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.plan import waits
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.collector import collect_step
from gtpo_megatron.rollout.engine_guard import GuardedEngine
from gtpo_megatron.rollout.exchange import StepExchange
from gtpo_megatron.rollout.pipeline import AsyncRollouts
from tests.helpers.dist_harness import run_distributed
from tests.trainer.fakes import FakeEngine, fake_collector

pytestmark = pytest.mark.distributed

OLD_LIMIT_S = 1.0  # the former fixed 30 minutes, scaled
TIMEOUT_S = 3.0  # rollout.timeout_s, above the old limit
SLOW_S = 2.0  # an engine slower than the old limit, within rollout.timeout_s
MARGIN_S = 1.0  # WORLD_TIMEOUT_MARGIN_S, scaled
PLACEMENT = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
COMMON = ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused", "rollout.num_prompts=2", "algorithm.group_size=2",
          "rollout.max_tokens=4", f"rollout.timeout_s={TIMEOUT_S}", "reward.timeout_s=0.1"]  # fmt: skip
ASYNC = ["rollout.placement=separate", "rollout.mode=async", "rollout.max_staleness=2", "trainer.max_steps=3"]


class _TimedEngine(FakeEngine):
    """``FakeEngine`` whose ``generate`` calls take ``SLOW_S`` each, and from call ``hang_at`` (1-based) never end."""

    def __init__(self, hang_at: int | None = None):
        super().__init__()
        self.hang_at = hang_at

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        hung = self.hang_at is not None and len(self.calls) + 1 >= self.hang_at
        threading.Event().wait(600.0 if hung else SLOW_S)  # a hung engine's thread is left behind (daemon)
        return super().generate(prompt_ids, n, sampling, prompt_indices)


def _world(cfg) -> dist.ProcessGroup:
    """A gloo group of both ranks with the run's world timeout (the margin scaled)."""
    waits.WORLD_TIMEOUT_MARGIN_S = MARGIN_S
    assert cfg.world_timeout_s == cfg.longest_wait_s + MARGIN_S < 60  # scaled down indeed
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.world_timeout_s))


def _exchange(cfg) -> StepExchange:
    return StepExchange.from_config(cfg, num_engines=1, group=_world(cfg))


def _collector(cfg, rank: int, hang_at: int | None, exchange: StepExchange):
    if rank != 0:
        return None
    engine = GuardedEngine(_TimedEngine(hang_at), placement=PLACEMENT, timeout_s=cfg.rollout.timeout_s)
    return fake_collector(cfg, engine, exchange=exchange)


def _loader(cfg) -> PromptLoader:
    return PromptLoader(load_problems("synthetic", limit=20), batch_size=cfg.rollout.num_prompts, seed=0)


def _sync_round(cfg, rank: int, hang_at: int | None):
    exchange = _exchange(cfg)
    return collect_step(_collector(cfg, rank, hang_at, exchange), _loader(cfg), 1, exchange)


def _async_step(cfg, rank: int, hang_at: int | None) -> list[str]:
    exchange = _exchange(cfg)
    rollouts = AsyncRollouts(cfg, collector=_collector(cfg, rank, hang_at, exchange), loader=_loader(cfg),
                             exchange=exchange)  # fmt: skip
    done = []
    try:
        rollouts.start(0)
        assert rollouts.take(1, None) is not None
        done.append("take")
        rollouts.drain(None)  # batches 2 and 3: up to max_staleness * rollout.timeout_s for the leader
        done.append("drain")
    finally:
        rollouts.close()
    return done


def _expect_engine_error(fn, *args) -> str:
    with pytest.raises(RuntimeError) as caught:
        fn(*args)
    message = str(caught.value)
    assert PLACEMENT.describe() in message and f"rollout.timeout_s={TIMEOUT_S:g}" in message, message
    assert "Timed out" not in message
    return message


def _check(rank: int, world_size: int) -> None:
    cfg = load_config(None, COMMON)
    assert cfg.rollout.timeout_s > OLD_LIMIT_S
    rollout = _sync_round(cfg, rank, None)  # the engine takes SLOW_S > OLD_LIMIT_S: no time-out
    assert rollout is not None and len(rollout.scores) == 4
    message = _expect_engine_error(_sync_round, cfg, rank, 1)
    assert "generation failed (TimeoutError" in message

    cfg = load_config(None, [*COMMON, *ASYNC])
    assert cfg.longest_wait_s == 2 * TIMEOUT_S
    assert _async_step(cfg, rank, None) == ["take", "drain"]  # the drain waits 2 * SLOW_S > rollout.timeout_s
    # batch 3 hangs: the drain's wait for it and the engine's own guard on the call both end after rollout.timeout_s
    # (which first is a race); either way the error names step 3
    message = _expect_engine_error(_async_step, cfg, rank, 3)
    assert "the async rollout of step 3 did not finish" in message or (
        "the async rollout of step 3 failed" in message and "generation failed (TimeoutError" in message
    ), message


def test_waits_for_an_engine_are_bounded_by_the_config_and_name_it_when_they_end():
    run_distributed(_check, 2)
