"""``build.build_trainer``: an engine leader's rollout side starts in the background while the policy loads; a
failed build leaves nothing running."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from gtpo_megatron import build, build_rollout
from gtpo_megatron.config import load_config
from tests.trainer.fakes import FakeEngine, FakePolicy, FakeRewardPool, one_rank_process_group, single_rank_groups

one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)


class _Pool(FakeRewardPool):
    closed = False

    def close(self):
        self.closed = True


def _cfg(tmp_path):
    return load_config(None, ["model=builtin:tiny-llama", f"output_dir={tmp_path}", "logging.wandb_mode=disabled"])


def test_the_rollout_side_starts_while_the_policy_loads(tmp_path, monkeypatch, caplog):
    both_running = threading.Barrier(2, timeout=30)  # each side waits for the other: they must overlap
    collector = SimpleNamespace(engine=FakeEngine(), reward_pool=_Pool())

    def build_collector(cfg, model_path, tokenizer, placement, environment, exchange, cores=None):
        both_running.wait()
        return collector

    def build_policy(cfg, model_path, groups):
        both_running.wait()
        return FakePolicy()

    monkeypatch.setattr(build, "build_collector", build_collector)
    monkeypatch.setattr(build, "build_policy", build_policy)
    paths = []

    def build_weight_sync(cfg, groups, engine, placements, policy):
        paths.append(cfg.rollout.weight_sync)

    monkeypatch.setattr(build, "build_weight_sync", build_weight_sync)
    timer = build.PhaseTimer()
    with caplog.at_level(logging.INFO, logger=build.__name__):
        trainer = build.build_trainer(_cfg(tmp_path), single_rank_groups(), timer=timer)
    assert trainer.collector is collector
    # rollout.weight_sync=auto is resolved once (CPU: sharded), logged once, and every component sees the path
    assert paths == ["sharded"] and trainer.cfg.rollout.weight_sync == "sharded"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight sync:")]
    assert lines == ["weight sync: rollout.weight_sync=sharded (auto)"]
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


def test_the_exchange_carries_the_routed_experts_layout_of_an_moe_model_with_routing_replay(tmp_path):
    from transformers import Qwen2Config, Qwen3MoeConfig

    from gtpo_megatron.rollout.exchange import RoutingLayout

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    Qwen3MoeConfig(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8).save_pretrained(
        moe
    )
    Qwen2Config(num_hidden_layers=2).save_pretrained(dense)
    model = ["model=builtin:tiny-qwen3-moe", f"output_dir={tmp_path}"]
    cfg = load_config(None, [*model, "rollout.routing_replay=rollout"])
    exchange = build.build_exchange(cfg, str(moe), num_engines=2)
    assert exchange.routing == RoutingLayout(num_layers=3, top_k=2, num_experts=8)
    assert (exchange.num_engines, exchange.rollout, exchange.algorithm, exchange.reward) == (
        2, cfg.rollout, cfg.algorithm, cfg.reward
    )  # fmt: skip
    assert build.build_exchange(cfg, str(dense), num_engines=1).routing is None  # the policy refuses a dense model
    off = load_config(None, model)
    assert build.build_exchange(off, str(tmp_path / "absent"), num_engines=1).routing is None  # nothing read


def test_the_sharded_sync_is_refused_on_gpus(tmp_path, monkeypatch):
    cfg = load_config(None, ["model=builtin:tiny-llama", f"output_dir={tmp_path}", "rollout.weight_sync=sharded"])
    monkeypatch.setattr(build_rollout.torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"rollout.weight_sync='sharded': its wire is gloo .* use "
                                         r"rollout.weight_sync=collective"):  # fmt: skip
        build_rollout.build_weight_sync(cfg, single_rank_groups(), None, [], FakePolicy())
