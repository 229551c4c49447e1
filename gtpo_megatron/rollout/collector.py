"""The rollout and reward phases of a step, run on global rank 0 (where the engine and the reward pool live).

``RolloutCollector.collect(step)`` draws prompts from the resumable loader, samples G completions each with the
rollout engine, scores them in the reward pool and, with DAPO dynamic sampling (GTPO_SPEC section 5), repeats
with fresh prompts until ``num_prompts`` groups with varied rewards are found or ``dynamic_sampling_max_rounds`` is
reached (then uniform groups fill the batch, see ``data.sampling.choose_groups``). The result is a plain picklable
``StepRollout`` that the trainer broadcasts to every rank.

Sampling seeds are ``rollout.seed + 1000 * step + round``, so a resumed run samples exactly like the original one
given the same weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gtpo_megatron.config import AlgorithmConfig, RewardConfig, RolloutConfig
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.data.prompts import SYSTEM_PROMPT, build_prompt_ids
from gtpo_megatron.data.sampling import choose_groups, filter_uniform_groups, shape_rewards
from gtpo_megatron.rewards.pool import check_grader_failures
from gtpo_megatron.rewards.registry import reward_span
from gtpo_megatron.rollout.engine import RolloutEngine, SamplingConfig
from gtpo_megatron.rollout.types import PromptCompletions

_SEEDS_PER_STEP = 1000


@dataclass
class StepRollout:
    """One step's chosen groups and their reward results, B = P*G completions group by group.

    ``scores`` are the reward function's values, ``rewards`` the shaped ones (overlong penalty) the advantages
    use; ``loader_state`` is the loader position after this step (every rank stores it in checkpoints).
    """

    groups: list[PromptCompletions]
    references: list[str]
    scores: list[float]
    rewards: list[float]
    correct: list[bool]
    format_ok: list[bool]
    loader_state: dict[str, Any]
    stats: dict[str, float] = field(default_factory=dict)


class RolloutCollector:
    """Rank-0 owner of the engine, the reward pool, the tokenizer and the prompt loader.

    Args:
        engine: the rollout engine (``RolloutEngine`` protocol).
        reward_pool: object with ``score(completions, references, extraction=...) -> (results, stats)``
            (``rewards.RewardPool``).
        tokenizer: HF tokenizer used for the chat-templated prompts.
        loader: ``PromptLoader`` yielding ``num_prompts`` problems per call.
        rollout_cfg, algorithm_cfg, reward_cfg: their config sections.
        extraction: the answer-extraction mode (``reward.extraction`` resolved for ``data.source``).
        system_prompt: the system message of every prompt (``data.prompts.SYSTEM_PROMPTS[data.system_prompt]``).
    """

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        reward_pool,
        tokenizer,
        loader: PromptLoader,
        rollout_cfg: RolloutConfig,
        algorithm_cfg: AlgorithmConfig,
        reward_cfg: RewardConfig,
        extraction: str,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        self.engine = engine
        self.reward_pool = reward_pool
        self.tokenizer = tokenizer
        self.loader = loader
        self.rollout_cfg = rollout_cfg
        self.algorithm_cfg = algorithm_cfg
        self.reward_cfg = reward_cfg
        self.extraction = extraction
        self.system_prompt = system_prompt

    def _sampling(self, step: int, round_index: int) -> SamplingConfig:
        cfg = self.rollout_cfg
        return SamplingConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_tokens,
            stop=cfg.stop,
            seed=cfg.seed + _SEEDS_PER_STEP * step + round_index,
            logprobs=True,
        )

    def _one_round(self, step: int, round_index: int, stats: dict[str, float]):
        problems = self.loader.next_batch()
        prompt_ids = [build_prompt_ids(self.tokenizer, p.question, system_prompt=self.system_prompt) for p in problems]
        group_size = self.algorithm_cfg.group_size
        start = time.perf_counter()
        groups = self.engine.generate(prompt_ids, group_size, self._sampling(step, round_index))
        stats["time/generate_s"] += time.perf_counter() - start
        texts = [c.text for g in groups for c in g.completions]
        references = [p.answer for p in problems for _ in range(group_size)]
        results, reward_stats = self.reward_pool.score(texts, references, extraction=self.extraction)
        check_grader_failures(reward_stats, max_error_frac=self.reward_cfg.max_error_frac)
        stats["time/reward_s"] += reward_stats["seconds"]
        stats["reward/num_timeouts"] += reward_stats["num_timeouts"]
        stats["reward/num_errors"] += reward_stats["num_errors"]
        return groups, references, results

    def collect(self, step: int) -> StepRollout:
        """Sample, score and (with dynamic sampling) select this step's ``num_prompts`` groups."""
        cfg, group_size = self.algorithm_cfg, self.algorithm_cfg.group_size
        stats = {"time/generate_s": 0.0, "time/reward_s": 0.0, "reward/num_timeouts": 0.0, "reward/num_errors": 0.0}
        groups, references, results = [], [], []
        rounds = cfg.dynamic_sampling_max_rounds if cfg.dynamic_sampling else 1
        for round_index in range(rounds):
            new_groups, new_refs, new_results = self._one_round(step, round_index, stats)
            groups += new_groups
            references += new_refs
            results += new_results
            rewards = self._shaped(groups, results)
            varied = filter_uniform_groups(rewards, group_size).tolist() if cfg.dynamic_sampling else []
            if sum(varied) >= self.rollout_cfg.num_prompts:
                break
        stats["rollout/num_rounds"] = float(round_index + 1)
        stats["rollout/varied_group_frac"] = float(filter_uniform_groups(rewards, group_size).float().mean())
        chosen = (
            choose_groups(varied, self.rollout_cfg.num_prompts) if cfg.dynamic_sampling else list(range(len(groups)))
        )
        rows = [p * group_size + g for p in chosen for g in range(group_size)]
        return StepRollout(
            groups=[groups[p] for p in chosen],
            references=[references[r] for r in rows],
            scores=[results[r].score for r in rows],
            rewards=[float(rewards[r]) for r in rows],
            correct=[results[r].correct for r in rows],
            format_ok=[results[r].format_ok for r in rows],
            loader_state=self.loader.state_dict(),
            stats=stats,
        )

    def _shaped(self, groups: list[PromptCompletions], results) -> torch.Tensor:
        lengths = torch.tensor([len(c.token_ids) for g in groups for c in g.completions])
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        return shape_rewards(
            scores,
            lengths,
            self.algorithm_cfg,
            max_tokens=self.rollout_cfg.max_tokens,
            reward_span=reward_span(self.reward_cfg.name),
        )
