"""Two gloo ranks: a step's rollout with one engine (rank 0) and with two (ranks 0 and 1) is the same step.

Each leader draws the same prompts from its own loader, samples only its block of whole groups (seeded by the
global prompt index, as ``VLLMEngine`` does) and scores them in its own reward pool; the packed exchange gives every
rank the identical ``StepRollout``, and DAPO's dynamic sampling (one all-reduce of varied flags per round) picks
the same groups.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gtpo_megatron.config import load_config
from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.parallel import broadcast_object
from gtpo_megatron.rollout.collector import collect_step
from gtpo_megatron.rollout.exchange import StepExchange
from tests.helpers.dist_harness import run_distributed
from tests.trainer.fakes import SeededFakeEngine, fake_collector

pytestmark = pytest.mark.distributed

OVERRIDES = {
    "grpo": ["rollout.num_prompts=5", "algorithm.group_size=4", "rollout.max_tokens=6"],
    "dapo": [
        "algorithm=dapo",
        "rollout.num_prompts=5",
        "algorithm.group_size=2",
        "rollout.max_tokens=4",
        "algorithm.dynamic_sampling_max_rounds=4",
    ],
}


def _step(rank: int, num_engines: int, overrides: list[str]):
    cfg = load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused", *overrides])
    collector, engine = None, SeededFakeEngine()
    exchange = StepExchange.from_config(cfg, num_engines=num_engines, group=dist.group.WORLD)
    if rank < num_engines:  # world 2: leaders 0 (and 1)
        collector = fake_collector(cfg, engine, exchange=exchange, engine_index=rank)
    loader = PromptLoader(load_problems("synthetic", limit=40), batch_size=cfg.rollout.num_prompts, seed=0)
    rollout = collect_step(collector, loader, 3, exchange)
    return rollout, engine, loader.state_dict()


def _content(rollout):
    completions = [(g.prompt_ids, c.token_ids, c.rollout_logprobs, c.finish_reason)
                   for g in rollout.groups for c in g.completions]  # fmt: skip
    keys = ("rollout/num_rounds", "rollout/varied_group_frac")
    return completions, rollout.scores, rollout.rewards, rollout.correct, [rollout.stats[k] for k in keys]


def _check(rank: int, world_size: int) -> None:
    for name, overrides in OVERRIDES.items():
        one, engine_one, _ = _step(rank, 1, overrides)
        two, engine_two, position = _step(rank, 2, overrides)
        assert _content(one) == _content(two), name  # the same completions, scores and choices
        assert _content(broadcast_object(two, src=0, group=dist.group.WORLD)) == _content(two)  # on every rank
        tokens = sum(len(c.token_ids) for g in two.groups for c in g.completions)
        if name == "grpo":  # 5 groups: engine 0 samples prompts 0-2, engine 1 prompts 3-4 (global indices)
            assert engine_two.prompt_indices == ([[0, 1, 2]] if rank == 0 else [[3, 4]])
            assert engine_one.prompt_indices == ([[0, 1, 2, 3, 4]] if rank == 0 else [])
            per_engine = (two.stats["rollout/tokens_per_engine_min"], two.stats["rollout/tokens_per_engine_max"])
            assert sum(per_engine) == tokens and min(per_engine) > 0
            assert one.stats["rollout/tokens_per_engine_max"] == tokens and one.stats["rollout/num_engines"] == 1
        else:  # dynamic sampling took several rounds with these seeds, in step on both leaders
            assert len(engine_two.calls) == one.stats["rollout/num_rounds"] > 1
        assert two.stats["rollout/num_engines"] == 2.0
        # every rank's loader drew every round's prompts: the same position for checkpoints everywhere
        assert broadcast_object(position, src=0, group=dist.group.WORLD) == position
        assert position["position"] == 5 * two.stats["rollout/num_rounds"]


def test_one_and_two_engines_give_the_same_step():
    run_distributed(_check, 2)
