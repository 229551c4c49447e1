"""Partial rollouts (``rollout.partial_rollouts``) in the loop over the fakes: in-flight updates, token versions,
the staleness bound in the loss, the version histogram, the config's refusals and the async engine's pause order.

``_PartialEngine`` labels each completion's first half with the version it held when the batch started and the
second half with the one it holds when the batch ends; batch 2 (queued with the start weights, k = 1) waits until
the weights after step 1 land in flight, so its completions hold versions 0 then 1.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.config.weight_sync import choose_weight_sync
from gtpo_megatron.ops import compute_normalizer, policy_objective
from gtpo_megatron.plan.engines import EnginePlacement
from gtpo_megatron.rollout.engine_guard import GuardedEngine, load_in_flight
from gtpo_megatron.rollout.vllm_async_engine import AsyncFacade, AsyncVLLMEngine, EventLoopThread
from tests.trainer.fakes import (
    FakePolicy,
    SeededFakeEngine,
    _fake_logprobs_entropy,
    make_trainer,
    one_rank_process_group,
)

one_rank_world = pytest.fixture(scope="module", autouse=True)(one_rank_process_group)
PARTIAL = (
    "rollout.placement=separate", "rollout.mode=async", "rollout.partial_rollouts=true", "rollout.weight_sync=files",
    "algorithm.off_policy_correction=tis", "checkpoint.every_n_steps=0",
)  # fmt: skip
WAIT_S = 60.0


class _PartialEngine(SeededFakeEngine):
    """In-flight updates logged in order; ``hold``: batches that wait for the next version; ``lag_first``: the first
    half's version is reported that much older (a token beyond the staleness bound)."""

    def __init__(self, hold=(2,), lag_first=0):
        super().__init__()
        self.log, self.version, self.hold, self.lag_first = [], None, hold, lag_first
        self.updated = threading.Condition()

    def pause(self):
        self.log.append("pause")

    def resume(self, version):
        with self.updated:
            self.version = self.version if version is None else version
            self.updated.notify_all()
        self.log.append(f"resume{version}")

    def finish_weight_update(self):
        super().finish_weight_update()
        self.log.append("load")

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        step, first = sampling.seed // 1000, self.version
        if step in self.hold:
            with self.updated:
                assert self.updated.wait_for(lambda: self.version > first, WAIT_S)
        groups = super().generate(prompt_ids, n, sampling, prompt_indices)
        for completion in (c for g in groups for c in g.completions):
            half = (len(completion.token_ids) + 1) // 2
            tail = len(completion.token_ids) - half
            completion.token_versions = [first - self.lag_first] * half + [self.version] * tail
        self.log.append(f"gen{step}")
        return groups


def _run(tmp_path, engine, *overrides):
    policy = FakePolicy()
    trainer = make_trainer(tmp_path, *PARTIAL, *overrides, engine=engine, policy=policy)
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trainer.close()
    return policy, rows


def test_weights_land_in_flight_and_a_batch_holds_tokens_of_two_versions(tmp_path):
    engine = _PartialEngine()
    _, rows = _run(tmp_path, engine)
    # The start weights are labelled, then each push pauses, loads and resumes while batch 2 is in flight.
    assert engine.log[0] == "resume0"
    assert engine.log.index("gen1") < engine.log.index("resume1") < engine.log.index("gen2")
    pushes = [i for i, event in enumerate(engine.log) if event == "pause"]
    assert len(pushes) == 2  # the weights after steps 1 and 2 (batches 3 and 4 use them); none after 3 and 4
    for i in pushes:
        assert engine.log[i + 1] == "load" and engine.log[i + 2].startswith("resume")
    step2 = rows[1]
    assert step2["async/staleness_max"] == 1.0  # batch 2 trains the policy after step 1: lag 1 then 0
    assert 0 < step2["async/version_frac_lag0"] < 1 and step2["async/version_frac_lag1"] > 0
    assert step2["async/stale_tokens"] == 0.0 and "async/pause_s" in step2


class _TogetherEngine(_PartialEngine):
    """Batch 1 finishes only once batch 2 has started: a worker that samples one batch after the other never gets
    there (its bounded wait then fails the run)."""

    def __init__(self):
        super().__init__(hold=())
        self.second_started = threading.Event()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        step = sampling.seed // 1000
        if step == 2:
            self.second_started.set()
        if step == 1:
            assert self.second_started.wait(WAIT_S), "batch 2 was not in the engine while batch 1 generated"
        return super().generate(prompt_ids, n, sampling, prompt_indices)


def test_the_engine_holds_the_requests_of_every_queued_batch_at_once(tmp_path):
    engine = _TogetherEngine()
    _, rows = _run(tmp_path, engine, "trainer.max_steps=2")
    assert engine.second_started.is_set() and [r["step"] for r in rows] == [1, 2]  # batch 1 ended, so 2 was in


def test_tokens_past_the_bound_leave_the_loss_and_it_matches_float64(tmp_path):
    overrides = ("algorithm.entropy_filter=off", "algorithm.entropy_penalty=0", "algorithm.aggregation=token-mean",
                 "trainer.max_steps=2")  # fmt: skip
    policy, rows = _run(tmp_path, _PartialEngine(hold=(), lag_first=2), *overrides)
    batch, spec, _ = policy.train_batches[0]  # step 1: first halves sampled "2 versions" before the start: stale
    assert rows[0]["async/stale_tokens"] > 0 and rows[0]["async/staleness_max"] == 2.0
    kept = batch.loss_mask
    logprobs, entropy = _fake_logprobs_entropy(batch)
    loss, _, _ = policy_objective(logprobs, entropy, batch, spec, compute_normalizer(kept, spec.aggregation))
    total, count = 0.0, 0
    for i in range(batch.num_sequences):  # float64, token by token: ratio 1, TIS weight min(pi / mu, 2)
        for t in range(batch.input_ids.shape[1]):
            if kept[i, t]:
                rho = math.exp(-1.0 - float(batch.rollout_logprobs[i, t].double()))
                total -= min(rho, 2.0) * float(batch.advantages[i]) * float(batch.token_weights[i, t])
                count += 1
    assert math.isclose(float(loss), total / count, rel_tol=1e-6, abs_tol=1e-9)
    sampled = (batch.rollout_logprobs != 0).sum(dim=1)  # every sampled token (the fake's log-probs are < 0)
    assert kept.sum(dim=1).tolist() == (sampled - (sampled + 1) // 2).tolist()  # the second halves only


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["rollout.mode=sync"],
            r"rollout.partial_rollouts/rollout.mode/rollout.placement=\(True, 'sync', 'separate'\)",
        ),
        (["rollout.placement=colocated", "rollout.mode=sync"], r"=\(True, 'sync', 'colocated'\): in-flight"),
        (["rollout.routing_replay=rollout"], r"rollout.partial_rollouts/rollout.routing_replay=\(True, 'rollout'\)"),
        (["rollout.max_staleness=0"], r"rollout.max_staleness=0: must be >= 1"),
    ],
)
def test_bad_partial_settings_are_refused(overrides, match):
    base = ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", "rollout.placement=separate", "rollout.mode=async",
            "rollout.partial_rollouts=true", "rollout.weight_sync=files"]  # fmt: skip
    with pytest.raises(ValueError, match=match):
        load_config(None, [*base, *overrides])


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        ([], "sharded"),
        (["rollout.num_engines=2"], "sharded"),
        (["rollout.num_engines=2", "rollout.weight_sync=collective"], "collective"),
        (["rollout.num_engines=2", "rollout.fault_tolerance=true"], "collective"),
    ],
)
def test_partial_rollouts_take_any_sync_path_and_fault_tolerance(overrides, path):
    base = ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *PARTIAL[:3], "rollout.weight_sync=auto"]
    cfg = load_config(None, [*base, *overrides])
    assert choose_weight_sync(cfg.rollout, accelerator=False).path == path


def test_partial_rollouts_without_a_clipped_importance_weight_are_refused():
    base = ["model=builtin:tiny-qwen2", "output_dir=/tmp/x", *PARTIAL[:4]]
    with pytest.raises(ValueError, match=r"algorithm.off_policy_correction/rollout.partial_rollouts=\('none', True\)"):
        load_config(None, base).validate(1)
    load_config(None, [*base, "algorithm.off_policy_correction=mis"]).validate(1)


class _FakeAsyncLLM:
    """Records the calls ``AsyncFacade`` makes on ``AsyncLLM`` (coroutines, run on the facade's loop)."""

    def __init__(self):
        self.calls = []

    async def pause_generation(self, **kwargs):
        self.calls.append(("pause", kwargs))

    async def update_weight_version(self, version):
        self.calls.append(("label", version))

    async def resume_generation(self):
        self.calls.append(("resume", {}))

    async def collective_rpc(self, method, args=()):
        await asyncio.sleep(0)
        self.calls.append(("rpc", method))
        return [None]


@pytest.mark.parametrize("fails", [False, True])
def test_the_async_engine_pauses_keeping_its_cache_loads_labels_and_resumes_in_order(fails):
    llm, loop = _FakeAsyncLLM(), EventLoopThread()
    facade = AsyncFacade(llm, loop)
    engine = AsyncVLLMEngine.__new__(AsyncVLLMEngine)  # not started: its facade answers
    engine._llm = facade
    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(engine, placement=placement, timeout_s=WAIT_S)

    def load():
        facade.collective_rpc("gtpo_reload_weights", ("/staging",))
        if fails:
            raise RuntimeError("reload failed")

    try:
        if fails:
            with pytest.raises(RuntimeError, match="reload failed"):
                load_in_flight(guarded, 3, load)
        else:
            load_in_flight(guarded, 3, load)
    finally:
        loop.stop()
    expected = [("pause", {"mode": "keep", "clear_cache": False}), ("rpc", "gtpo_reload_weights")]
    expected += [("resume", {})] if fails else [("label", "3"), ("resume", {})]
    assert llm.calls == expected


class _SignalAfterUpdate(FakePolicy):
    """Sends ``signum`` at the end of update ``at``."""

    def __init__(self, at, signum):
        super().__init__()
        self.at, self.signum = at, signum

    def train_step(self, batch, loss):
        metrics = super().train_step(batch, loss)
        if len(self.train_batches) == self.at:
            os.kill(os.getpid(), self.signum)
        return metrics


class _HeldEngine(_PartialEngine):
    """Batch ``held`` lasts until ``release`` is set: it is mid-generation when the signal stops the run."""

    def __init__(self, held):
        super().__init__(hold=())
        self.held, self.release = held, threading.Event()

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        if sampling.seed // 1000 == self.held:
            self.release.wait(WAIT_S)
        return super().generate(prompt_ids, n, sampling, prompt_indices)


@pytest.mark.parametrize(("signum", "in_flight"), [(signal.SIGTERM, [3]), (signal.SIGUSR1, [3, 4])])
def test_a_stop_saves_the_unfinished_batches_and_a_resume_regenerates_them_with_the_resumed_weights(
    tmp_path, signum, in_flight
):
    full = make_trainer(tmp_path / "full", *PARTIAL, engine=_PartialEngine(hold=()))
    full.run()
    full.close()
    cut = make_trainer(tmp_path / "cut", *PARTIAL, engine=_HeldEngine(3), policy=_SignalAfterUpdate(2, signum))
    cut.run()
    cut.collector.engine.release.set()
    cut.close()
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["rollout_in_flight"] == in_flight  # requests still generating: saved as their steps' batches
    resumed = make_trainer(tmp_path / "cut", *PARTIAL, "resume=true", engine=_PartialEngine(hold=()))
    resumed.run()
    resumed.close()
    prompts = lambda t: [c[0] for c in sorted(t.collector.engine.calls, key=lambda c: c[2].seed)]  # noqa: E731
    assert prompts(resumed) == prompts(full)[2:]  # steps 3 and 4 sampled again: no prompt lost or repeated
    log = resumed.collector.engine.log  # the resumed weights load, then label the regenerated batches' tokens
    assert log[:2] == ["load", "resume2"] and len(resumed.policy.train_batches) == 2
