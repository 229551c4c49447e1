"""``build.build_trainer``: an engine leader's rollout side starts in the background while the policy loads; a
failed build leaves nothing running."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gtpo_megatron import build
from gtpo_megatron.config import load_config
from tests.trainer.fakes import FakeEngine, FakePolicy, FakeRewardPool, one_rank_process_group, single_rank_groups

one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)


class _Pool(FakeRewardPool):
    closed = False

    def close(self):
        self.closed = True


def _cfg(tmp_path):
    return load_config(None, ["model=builtin:tiny-llama", f"output_dir={tmp_path}", "logging.wandb_mode=disabled"])


def test_the_rollout_side_starts_while_the_policy_loads(tmp_path, monkeypatch):
    both_running = threading.Barrier(2, timeout=30)  # each side waits for the other: they must overlap
    collector = SimpleNamespace(engine=FakeEngine(), reward_pool=_Pool())

    def build_collector(cfg, model_path, tokenizer, placement, environment, exchange):
        both_running.wait()
        return collector

    def build_policy(cfg, model_path, groups):
        both_running.wait()
        return FakePolicy()

    monkeypatch.setattr(build, "build_collector", build_collector)
    monkeypatch.setattr(build, "build_policy", build_policy)
    monkeypatch.setattr(build, "build_weight_sync", lambda cfg, groups, engine, placements: None)
    timer = build.PhaseTimer()
    trainer = build.build_trainer(_cfg(tmp_path), single_rank_groups(), timer=timer)
    assert trainer.collector is collector
    phases = {"tokenizer", "rollout_side", "policy", "metric_sink", "rollout_side_wait", "weight_sync"}
    assert {k[len("time/startup/") : -2] for k in timer.seconds} == phases
    trainer.sink.close()


def test_a_failed_policy_build_closes_the_rollout_side(tmp_path, monkeypatch):
    collector = SimpleNamespace(engine=FakeEngine(), reward_pool=_Pool())
    monkeypatch.setattr(build, "build_collector", lambda cfg, model_path, tokenizer, *placement: collector)

    def build_policy(cfg, model_path, groups):
        raise ValueError("model.name_or_path=...: bad checkpoint")

    monkeypatch.setattr(build, "build_policy", build_policy)
    with pytest.raises(ValueError, match="bad checkpoint"):
        build.build_trainer(_cfg(tmp_path), single_rank_groups())
    assert collector.engine.events == ["close"] and collector.reward_pool.closed
