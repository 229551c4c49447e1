"""The rollout and reward phases of a step: every engine leader samples and scores its share, every rank gets all.

Every rank draws the same prompts from an identically built loader; each engine leader samples G completions for
its block of whole groups (``plan.engines.engine_prompt_range``), seeded by ``rollout.seed + 1000 * step + round``
and the prompt's global index (``rollout.engine.request_seed``): independent of the engine count, and a resumed run
samples as the original. With DAPO dynamic sampling (docs/algorithm.md section 5) rounds repeat until
``num_prompts`` groups vary in their task score (never the shaped rewards) or ``dynamic_sampling_max_rounds``. The
chosen groups cross ranks once as one packed tensor (``rollout/exchange.py``) and every rank rebuilds the same
``StepRollout``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.data.dynamic_sampling import choose_groups, filter_uniform_groups
from gtpo_megatron.data.loader import PromptLoader
from gtpo_megatron.data.overlong import shape_rewards
from gtpo_megatron.data.prompts import SYSTEM_PROMPT, build_prompt_ids
from gtpo_megatron.data.types import Problem
from gtpo_megatron.parallel.collectives import all_reduce_sum
from gtpo_megatron.plan.engines import engine_prompt_range
from gtpo_megatron.preemption import StepInterrupted, StopRequests
from gtpo_megatron.rewards.pool import check_grader_failures
from gtpo_megatron.rewards.registry import reward_span
from gtpo_megatron.rollout.engine import RolloutEngine, SamplingConfig
from gtpo_megatron.rollout.exchange import (
    ENGINE_COUNTERS,
    EngineTally,
    ScoredGroup,
    StepExchange,
    attach_routed_experts,
    pack_routed_experts,
    pack_rows,
    raise_leader_failures,
    unpack_rows,
)

if TYPE_CHECKING:
    from gtpo_megatron.rollout.fault_tolerance import FaultTolerance

logger = logging.getLogger(__name__)

_SEEDS_PER_STEP = 1000


@dataclass
class StepRollout:
    """One step's B = P*G completions group by group (no text): task ``scores`` and shaped ``rewards``."""

    groups: list
    scores: list[float]
    rewards: list[float]
    correct: list[bool]
    format_ok: list[bool]
    stats: dict[str, float] = field(default_factory=dict)


class RolloutCollector:
    """An engine leader's engine, reward pool and tokenizer, and its share of every round.

    ``reward_pool``: a ``rewards.RewardPool``; ``exchange``: the step exchange (its sections and engine count);
    ``extraction``: ``reward.extraction`` resolved for ``data.source``; ``engine_index``:
    ``plan.engines.EnginePlacement.index``; ``cores``: the CPU cores of the rollout side (its engine's,
    ``build_rollout.bind_training_rank``), else None.
    """

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        reward_pool,
        tokenizer,
        exchange: StepExchange,
        extraction: str,
        system_prompt: str = SYSTEM_PROMPT,
        engine_index: int = 0,
        cores: tuple[int, ...] | None = None,
    ) -> None:
        self.engine = engine
        self.reward_pool = reward_pool
        self.tokenizer = tokenizer
        self.exchange = exchange
        self.extraction = extraction
        self.system_prompt = system_prompt
        self.engine_index = engine_index
        self.cores = cores
        self._scoring = threading.Lock()  # batches sampled side by side (partial rollouts) grade one at a time

    def _sampling(self, step: int, round_index: int) -> SamplingConfig:
        cfg = self.exchange.rollout
        return SamplingConfig(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_tokens,
            stop=cfg.stop,
            seed=cfg.seed + _SEEDS_PER_STEP * step + round_index,
            logprobs=True,
        )

    def share(self) -> range:
        """Global indices (within a round) of the prompts this leader's engine samples."""
        num_prompts = self.exchange.rollout.num_prompts
        return engine_prompt_range(num_prompts, num_engines=self.exchange.num_engines, index=self.engine_index)

    def sample_round(
        self,
        step: int,
        round_index: int,
        problems: list[Problem],
        tally: EngineTally,
        share: Sequence[int] | None = None,
    ) -> dict[int, ScoredGroup]:
        """``{global prompt index: ScoredGroup}`` of this leader's share of a round; adds its counters to ``tally``.

        ``share``: the global prompt indices to sample (fault tolerance moves prompts), else :meth:`share`.

        Raises:
            RuntimeError: the graders failed on more than ``reward.max_error_frac`` of the answers.
            rollout.engine_guard.EngineFailure: the engine failed (naming it).
        """
        share, group_size = self.share() if share is None else list(share), self.exchange.algorithm.group_size
        if len(share) == 0:
            return {}
        prompt_ids = [
            build_prompt_ids(self.tokenizer, problems[i].question, system_prompt=self.system_prompt) for i in share
        ]
        start = time.perf_counter()
        groups = self.engine.generate(prompt_ids, group_size, self._sampling(step, round_index), prompt_indices=share)
        tally.generate_s += time.perf_counter() - start
        texts = [c.text for g in groups for c in g.completions]
        references = [problems[i].answer for i in share for _ in range(group_size)]
        with self._scoring:
            results, reward_stats = self.reward_pool.score(texts, references, extraction=self.extraction)
        check_grader_failures(reward_stats, max_error_frac=self.exchange.reward.max_error_frac)
        tally.tokens += sum(len(c.token_ids) for g in groups for c in g.completions)
        tally.reward_s += reward_stats["seconds"]
        tally.num_timeouts += reward_stats["num_timeouts"]
        tally.num_errors += reward_stats["num_errors"]
        scored = {}
        for k, (index, group) in enumerate(zip(share, groups, strict=True)):
            mine = results[k * group_size : (k + 1) * group_size]
            scored[index] = ScoredGroup(group, [r.score for r in mine], [r.correct for r in mine],
                                        [r.format_ok for r in mine])  # fmt: skip
        return scored


def collect_step(
    collector: RolloutCollector | None,
    loader: PromptLoader,
    step: int,
    exchange: StepExchange,
    *,
    stop: StopRequests | None = None,
    recovery: FaultTolerance | None = None,
) -> StepRollout | None:
    """Sample, score, select and share this step's groups; every rank calls (``collector``: a leader's, else None).

    The same ``StepRollout`` on every rank, or None on all when a stop signal made a leader leave its rollout.
    Collectives: a SUM of ``[P]`` varied flags per dynamic-sampling round, then :func:`share_step`'s. Raises
    RuntimeError on every rank when a leader's engine or reward pool failed, naming the engine. ``recovery``
    (``rollout.fault_tolerance``) samples each round instead, moving a failed engine's prompts (its collectives).
    """
    sampled, varied, tally = _sample_rounds(collector, loader, step, exchange, stop, recovery)
    engine_index = None if collector is None else collector.engine_index
    rollout = share_step(sampled, varied, tally, exchange, engine_index=engine_index)
    if recovery is not None and rollout is not None:
        rollout.stats.update(recovery.step_stats())
    return rollout


def share_step(
    sampled: list[dict[int, ScoredGroup]],
    varied: list[bool],
    tally: EngineTally,
    exchange: StepExchange,
    *,
    engine_index: int | None,
) -> StepRollout | None:
    """Select and share a step's groups; the same ``StepRollout`` on every rank (None on all when a leader aborted).

    ``sampled``: this rank's scored groups per round; ``varied``: the rounds' varied flags (dynamic sampling, else
    empty); ``tally``: this leader's counters (``engine_index`` None off the leaders). Collectives: a SUM of the rows
    and counters, a second of the routed experts with ``exchange.routing``, ``raise_leader_failures``' after a
    failure, which raises RuntimeError on every rank naming the engine.
    """
    algorithm_cfg, group, routing = exchange.algorithm, exchange.group, exchange.routing
    num_prompts, group_size = exchange.rollout.num_prompts, algorithm_cfg.group_size
    chosen = choose_groups(varied, num_prompts) if algorithm_cfg.dynamic_sampling else list(range(num_prompts))
    slots = {}
    for slot, flat in enumerate(chosen):
        scored_group = sampled[flat // num_prompts].get(flat % num_prompts)
        if scored_group is not None:
            slots[slot] = scored_group
    layout = exchange.layout
    rows = pack_rows(slots, num_groups=num_prompts, group_size=group_size, layout=layout)
    counters = torch.zeros(exchange.num_engines, len(ENGINE_COUNTERS), dtype=torch.float64)
    if engine_index is not None:
        counters[engine_index] = tally.as_tensor()
    summed = all_reduce_sum(torch.cat([rows.reshape(-1), counters.reshape(-1)]), group=group)
    counters = summed[rows.numel() :].reshape(counters.shape)
    if counters[:, ENGINE_COUNTERS.index("failed")].sum() > 0:
        raise_leader_failures(tally.error, group=group)
    if counters[:, ENGINE_COUNTERS.index("aborted")].sum() > 0:
        return None
    gathered = unpack_rows(summed[: rows.numel()].reshape(rows.shape), group_size=group_size, layout=layout)
    if routing is not None:
        wire = pack_routed_experts(slots, num_groups=num_prompts, group_size=group_size, layout=layout, routing=routing)
        attach_routed_experts(all_reduce_sum(wire, group=group), gathered.groups)
    scores = torch.tensor(gathered.scores, dtype=torch.float32)
    rewards = shape_rewards(scores, torch.tensor(gathered.lengths), algorithm_cfg, max_tokens=layout.max_tokens,
                            reward_span=reward_span(exchange.reward.name))  # fmt: skip
    varied_frac = torch.tensor(varied).float().mean() if varied else filter_uniform_groups(scores, group_size).float()
    stats = _engine_stats(counters)
    stats["rollout/num_rounds"] = float(len(sampled))
    stats["rollout/varied_group_frac"] = float(varied_frac.mean())
    return StepRollout(groups=gathered.groups, scores=gathered.scores, rewards=rewards.tolist(),
                       correct=gathered.correct, format_ok=gathered.format_ok, stats=stats)  # fmt: skip


def _sample_rounds(
    collector: RolloutCollector | None,
    loader: PromptLoader,
    step: int,
    exchange: StepExchange,
    stop: StopRequests | None,
    recovery: FaultTolerance | None,
) -> tuple[list[dict[int, ScoredGroup]], list[bool], EngineTally]:
    """This rank's scored groups per round, the global varied flags and this leader's counters (``aborted``)."""
    algorithm_cfg, num_prompts = exchange.algorithm, exchange.rollout.num_prompts
    rounds = algorithm_cfg.dynamic_sampling_max_rounds if algorithm_cfg.dynamic_sampling else 1
    tally, sampled, varied = EngineTally(), [], []
    for round_index in range(rounds):
        problems = loader.next_batch()
        scored = {}
        if recovery is not None:
            sample = functools.partial(_sample_interruptibly, collector, step, round_index, problems, tally, stop)
            scored = recovery.sample_round(sample, tally)
        elif collector is not None and not (tally.aborted or tally.failed):
            try:
                scored = _sample_interruptibly(collector, step, round_index, problems, tally, stop)
            except Exception as err:  # shared at the exchange: the other ranks wait there for this batch
                tally.fail(err)
        sampled.append(scored)
        if not algorithm_cfg.dynamic_sampling:
            break
        local = torch.zeros(num_prompts, dtype=torch.float64)
        for index, scored_group in scored.items():
            local[index] = float(filter_uniform_groups(scored_group.scores, algorithm_cfg.group_size)[0])
        varied += (all_reduce_sum(local, group=exchange.group) > 0.5).tolist()
        if sum(varied) >= num_prompts:
            break
    return sampled, varied, tally


def _sample_interruptibly(
    collector: RolloutCollector,
    step: int,
    round_index: int,
    problems: list[Problem],
    tally: EngineTally,
    stop: StopRequests | None,
    share: Sequence[int] | None = None,
) -> dict[int, ScoredGroup]:
    """``collector.sample_round``, left on SIGTERM (``tally.aborted = 1``; any failure after one counts as it)."""
    if stop is None:
        return collector.sample_round(step, round_index, problems, tally, share)
    try:
        with stop.interruptible():
            return collector.sample_round(step, round_index, problems, tally, share)
    except (StepInterrupted, Exception) as err:
        if not stop.abort_requested:
            raise
        logger.warning("%s during the rollout of step %d: rollout abandoned (%s)", stop.describe(), step,
                       type(err).__name__)  # fmt: skip
        tally.aborted = 1.0
        return {}


def _engine_stats(counters: torch.Tensor) -> dict[str, float]:
    """Step metrics from the ``[N, K]`` per-engine counters: slowest engine's times, summed grader failures."""
    column = {name: counters[:, i] for i, name in enumerate(ENGINE_COUNTERS)}
    busy_s = float(column["busy_s"].max())  # async mode only
    return ({"async/engine_busy_s": busy_s} if busy_s > 0 else {}) | {
        "rollout/num_engines": float(counters.shape[0]),
        "rollout/tokens_per_engine_min": float(column["tokens"].min()),
        "rollout/tokens_per_engine_max": float(column["tokens"].max()),
        "time/generate_s": float(column["generate_s"].max()),
        "time/reward_s": float(column["reward_s"].max()),
        "reward/num_timeouts": float(column["num_timeouts"].sum()),
        "reward/num_errors": float(column["num_errors"].sum()),
    }
