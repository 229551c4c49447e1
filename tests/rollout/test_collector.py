"""``collect_step`` in one process: shares, seeds, counters, and variance decisions on task scores."""

from __future__ import annotations

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.preemption import StopRequests
from gtpo_megatron.rollout.collector import collect_step
from gtpo_megatron.rollout.exchange import StepExchange
from gtpo_megatron.rollout.types import Completion, PromptCompletions
from tests.trainer.fakes import EOS, FakeEngine, SeededFakeEngine, fake_collector


class _LengthsOnly(FakeEngine):
    """Every group: completions of 20 tokens (truncated) and 10 tokens, both answering "0" (score 0)."""

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.calls.append(([list(p) for p in prompt_ids], n, sampling))
        long = Completion([5] * 20, [-1.0] * 20, "0", "length")
        short = Completion([6] * 9 + [EOS], [-1.0] * 10, "0", "stop")
        return [PromptCompletions(list(p), [long, short][:n]) for p in prompt_ids]


def _collect(engine, *overrides, step=1, stop=None):
    cfg = load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused", *overrides])
    exchange = StepExchange.from_config(cfg, num_engines=1, group=None)
    collector = fake_collector(cfg, engine, exchange=exchange)
    loader = PromptLoader(load_problems("synthetic", limit=40), batch_size=cfg.rollout.num_prompts, seed=0)
    rollout = collect_step(collector, loader, step, exchange, stop=stop)
    return loader, rollout


# math_verify scores in [0, 1], so the overlong penalty is 1 (rewards.reward_span)
DAPO = ["algorithm=dapo", "algorithm.group_size=2", "rollout.num_prompts=3", "rollout.max_tokens=20",
        "algorithm.overlong_buffer_len=4", "algorithm.dynamic_sampling_max_rounds=3",
        "reward.name=math_verify"]  # fmt: skip


def test_groups_uniform_in_score_are_uniform_whatever_the_overlong_penalty():
    """G=2, scores [0, 0], lengths 20 and 10, max_tokens=20, buffer 4: shaped rewards [-1, 0] look varied, but
    dynamic sampling keeps drawing (3 rounds), ``rollout/varied_group_frac`` is 0 and the batch is uniform fill."""
    engine = _LengthsOnly()
    _, rollout = _collect(engine, *DAPO)
    assert rollout.rewards == [-1.0, 0.0] * 3 and rollout.scores == [0.0] * 6
    assert len(engine.calls) == 3 and rollout.stats["rollout/num_rounds"] == 3
    assert rollout.stats["rollout/varied_group_frac"] == 0.0
    _, plain = _collect(_LengthsOnly(), *DAPO, "algorithm.dynamic_sampling=false")
    assert plain.stats["rollout/varied_group_frac"] == 0.0 and plain.stats["rollout/num_rounds"] == 1


def test_groups_varied_in_score_stop_dynamic_sampling_at_once():
    engine = FakeEngine()  # texts alternate "9"/"0": every group varies in score
    _, rollout = _collect(engine, *DAPO)
    assert len(engine.calls) == 1 and rollout.stats["rollout/varied_group_frac"] == 1.0
    assert rollout.scores == [1.0, 0.0] * 3


def test_one_engine_samples_every_prompt_with_global_indices_and_counts_its_tokens():
    engine = SeededFakeEngine()
    _, rollout = _collect(engine, "rollout.num_prompts=3", "algorithm.group_size=4", "rollout.max_tokens=6", step=2)
    assert engine.prompt_indices == [[0, 1, 2]] and engine.calls[0][2].seed == 2000
    tokens = sum(len(c.token_ids) for g in rollout.groups for c in g.completions)
    assert rollout.stats["rollout/tokens_per_engine_min"] == rollout.stats["rollout/tokens_per_engine_max"] == tokens
    assert rollout.stats["rollout/num_engines"] == 1.0
    assert [c.text for g in rollout.groups for c in g.completions] == [""] * 12  # text stays with the leader
    assert rollout.stats["time/generate_s"] >= 0 and rollout.stats["reward/num_errors"] == 0


@pytest.mark.parametrize("uniform", [False, True])
def test_dynamic_sampling_fills_the_batch_in_sampling_order(uniform):
    engine = SeededFakeEngine(uniform_scores=uniform)
    _, rollout = _collect(engine, *DAPO, "rollout.max_tokens=6", "algorithm.overlong_buffer_len=2")
    assert len(rollout.groups) == 3 and len(rollout.scores) == 6
    if uniform:
        assert rollout.stats["rollout/num_rounds"] == 3 and rollout.stats["rollout/varied_group_frac"] == 0.0


class _DiesOnSigterm(FakeEngine):
    """A generation that fails on its first call, as vLLM's processes do when Slurm's SIGTERM reaches them too."""

    def __init__(self, stop, sigterm: bool):
        super().__init__()
        self.stop, self.sigterm = stop, sigterm

    def generate(self, prompt_ids, n, sampling, prompt_indices=None):
        self.calls.append(([list(p) for p in prompt_ids], n, sampling))
        self.stop.abort_requested = self.sigterm
        raise RuntimeError("EngineCore died")


def test_a_sigterm_in_the_rollout_abandons_the_step_on_every_rank():
    """The leader's failure after a SIGTERM is the interruption: the exchange still runs (no rank waits) and carries
    ``aborted``, so collect_step returns None; the same failure without a SIGTERM propagates."""
    stop = StopRequests(on_sigterm=True, on_sigusr1=False)
    engine = _DiesOnSigterm(stop, sigterm=True)
    _, rollout = _collect(engine, *DAPO, stop=stop)
    assert rollout is None and len(engine.calls) == 1  # the later dynamic-sampling rounds sample nothing
    stop = StopRequests(on_sigterm=True, on_sigusr1=False)
    with pytest.raises(RuntimeError, match="EngineCore died"):
        _collect(_DiesOnSigterm(stop, sigterm=False), stop=stop)
