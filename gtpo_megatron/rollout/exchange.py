"""A step's scored completions as one compact float64 tensor: what crosses ranks after the rollout phase.

Each engine leader fills its groups' rows of a zero ``[B, W]`` tensor and its row of the ``[N, K]`` counters; one
SUM all-reduce (``parallel.collectives.all_reduce_sum``) gives every rank the whole step exactly (float64 holds
token ids and fp32 log-probs exactly; each entry has one writer). Row layout (``Lp = rollout.max_prompt_len``,
``Lr = rollout.max_tokens``)::

    [prompt_len, response_len, score, correct, format_ok, truncated, prompt ids (Lp), response ids (Lr),
     rollout log-probs (Lr), token versions + 1 (Lr)]

Token versions (partial rollouts): the policy version that sampled each response token, + 1 so that 0 means "not
recorded" (a completion without ``token_versions``; unpacked as None). Integers below 2**53 are exact in float64.

With routing replay a second tensor follows (:class:`RoutingLayout`): ``[B, Lp + Lr, L, K]``, completion ``b``'s
experts of token ``t`` in MoE layer ``l`` as id + 1 (0: not recorded), summed like the rows; ids + 1 travel as uint8
(<= 254 experts) or int32 (gloo cannot sum int16), the encoding ``TrainBatch.routed_experts`` keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.parallel.collectives import all_gather_object
from gtpo_megatron.rollout.types import Completion, PromptCompletions

if TYPE_CHECKING:
    import torch.distributed as dist

    from gtpo_megatron.config import AlgorithmConfig, GTPOConfig, RewardConfig, RolloutConfig

_HEAD = ("prompt_len", "response_len", "score", "correct", "format_ok", "truncated")
ENGINE_COUNTERS = ("tokens", "generate_s", "reward_s", "busy_s", "num_timeouts", "num_errors", "aborted", "failed")
"""Per-engine counters of a step: generated tokens, seconds generating and scoring, async mode's busy seconds since
the previous take (``rollout/busy_clock.py``; 0 in sync mode), grader timeouts and errors, 1 when a SIGTERM made the
leader leave its rollout (``preemption``), and 1 when its rollout failed (:func:`raise_leader_failures`)."""


@dataclass
class ScoredGroup:
    """One prompt's G completions and their reward results (an engine leader's view, text included)."""

    completions: PromptCompletions
    scores: list[float]
    correct: list[bool]
    format_ok: list[bool]


@dataclass
class EngineTally:
    """One engine's counters over the rounds of a step (``ENGINE_COUNTERS``)."""

    tokens: float = 0.0
    generate_s: float = 0.0
    reward_s: float = 0.0
    busy_s: float = 0.0
    num_timeouts: float = 0.0
    num_errors: float = 0.0
    aborted: float = 0.0
    failed: float = 0.0
    error: BaseException | None = None
    """Why the rollout failed (``failed``), kept on the leader for :func:`raise_leader_failures`."""

    def fail(self, error: BaseException) -> None:
        """Record a failed rollout: the exchange still runs, then every rank raises naming ``error``."""
        self.failed, self.error = 1.0, error

    def drop_sampled(self) -> None:
        """Forget what was sampled and scored so far (a lost engine's batch, sampled again elsewhere)."""
        self.tokens = self.generate_s = self.reward_s = self.num_timeouts = self.num_errors = 0.0

    def as_tensor(self) -> torch.Tensor:
        """``[K]`` float64 in ``ENGINE_COUNTERS`` order."""
        return torch.tensor([getattr(self, k) for k in ENGINE_COUNTERS], dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Columns of a packed row: ``max_prompt_len`` prompt ids, ``max_tokens`` response ids, log-probs and versions."""

    max_prompt_len: int
    max_tokens: int

    @property
    def width(self) -> int:
        """W, the columns of one row."""
        return len(_HEAD) + self.max_prompt_len + 3 * self.max_tokens


@dataclass(frozen=True, slots=True)
class RoutingLayout:
    """The routed-experts tensor of a step (module docstring): L MoE layers, top-K of ``num_experts`` experts."""

    num_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        """uint8 when every id + 1 fits (at most 254 experts), else int32; both sum exactly on gloo and NCCL."""
        return torch.uint8 if self.num_experts < 255 else torch.int32


@dataclass(frozen=True, slots=True)
class StepExchange:
    """What every rank needs to sample, select and share a step: built once (``build.build_exchange``).

    ``rollout``, ``algorithm``, ``reward``: the run's sections; ``num_engines``: engines sharing each round;
    ``group``: the world group the step crosses (None: one process); ``routing``: the routed experts' layout with
    rollout routing replay, else None.
    """

    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig
    num_engines: int
    group: dist.ProcessGroup | None
    routing: RoutingLayout | None = None

    @classmethod
    def from_config(
        cls, cfg: GTPOConfig, *, num_engines: int, group: dist.ProcessGroup | None, routing: RoutingLayout | None = None
    ) -> StepExchange:
        """The exchange of ``cfg``'s rollout, algorithm and reward sections."""
        return cls(cfg.rollout, cfg.algorithm, cfg.reward, num_engines, group, routing)

    @property
    def layout(self) -> RowLayout:
        """The packed rows' columns (``rollout.max_prompt_len``, ``rollout.max_tokens``)."""
        return RowLayout(self.rollout.max_prompt_len, self.rollout.max_tokens)


@dataclass
class GatheredRows:
    """The unpacked step: groups (no text) and per-completion results, B = P*G entries in group order."""

    groups: list[PromptCompletions]
    scores: list[float]
    correct: list[bool]
    format_ok: list[bool]
    lengths: list[int] = field(default_factory=list)


def pack_rows(slots: dict[int, ScoredGroup], *, num_groups: int, group_size: int, layout: RowLayout) -> torch.Tensor:
    """``[num_groups * G, W]`` float64 zeros with the rows of the groups in ``slots`` (slot -> group) filled.

    Raises:
        ValueError: a slot out of range, a group of the wrong size, or a prompt/completion longer than the layout.
    """
    rows = torch.zeros(num_groups * group_size, layout.width, dtype=torch.float64)
    lp, lr = layout.max_prompt_len, layout.max_tokens
    for slot, group in slots.items():
        if not 0 <= slot < num_groups or len(group.completions.completions) != group_size:
            raise ValueError(f"group slot {slot} of {num_groups} with {len(group.completions.completions)} != G")
        prompt = group.completions.prompt_ids
        for j, completion in enumerate(group.completions.completions):
            tokens = completion.token_ids
            if len(prompt) > lp or len(tokens) > lr:
                raise ValueError(f"prompt of {len(prompt)} / completion of {len(tokens)} tokens exceed {lp} / {lr}")
            row = rows[slot * group_size + j]
            row[: len(_HEAD)] = torch.tensor([len(prompt), len(tokens), group.scores[j], group.correct[j],
                                              group.format_ok[j], completion.finish_reason == "length"])  # fmt: skip
            start = len(_HEAD)
            row[start : start + len(prompt)] = torch.tensor(prompt, dtype=torch.float64)
            row[start + lp : start + lp + len(tokens)] = torch.tensor(tokens, dtype=torch.float64)
            if completion.rollout_logprobs:
                row[start + lp + lr : start + lp + lr + len(tokens)] = torch.tensor(
                    completion.rollout_logprobs, dtype=torch.float64
                )
            if completion.token_versions is not None:
                versions = torch.tensor(completion.token_versions, dtype=torch.float64) + 1
                row[start + lp + 2 * lr : start + lp + 2 * lr + len(tokens)] = versions
    return rows


def unpack_rows(rows: torch.Tensor, *, group_size: int, layout: RowLayout) -> GatheredRows:
    """The inverse of :func:`pack_rows` on the summed ``[B, W]`` tensor (every row filled by one rank)."""
    lp, lr, start = layout.max_prompt_len, layout.max_tokens, len(_HEAD)
    rows = rows.cpu()
    head = rows[:, :start]
    groups, out = [], GatheredRows(groups=[], scores=[], correct=[], format_ok=[])
    for g in range(rows.shape[0] // group_size):
        block = rows[g * group_size : (g + 1) * group_size]
        prompt = [int(t) for t in block[0, start : start + int(block[0, 0])].tolist()]
        completions = []
        for row in block:
            n = int(row[1])
            versions = row[start + lp + 2 * lr : start + lp + 2 * lr + n]
            completions.append(
                Completion(
                    token_ids=[int(t) for t in row[start + lp : start + lp + n].tolist()],
                    rollout_logprobs=row[start + lp + lr : start + lp + lr + n].tolist(),
                    text="",
                    finish_reason="length" if row[5] > 0.5 else "stop",
                    token_versions=None if n and versions[0] == 0 else [int(v) - 1 for v in versions.tolist()],
                )
            )
        groups.append(PromptCompletions(prompt_ids=prompt, completions=completions))
    out.groups = groups
    out.scores = head[:, 2].tolist()
    out.correct = (head[:, 3] > 0.5).tolist()
    out.format_ok = (head[:, 4] > 0.5).tolist()
    out.lengths = [int(n) for n in head[:, 1].tolist()]
    return out


def pack_routed_experts(
    slots: dict[int, ScoredGroup], *, num_groups: int, group_size: int, layout: RowLayout, routing: RoutingLayout
) -> torch.Tensor:
    """``[num_groups * G, Lp + Lr, L, K]`` zeros (``routing.dtype``) with the filled groups' routed experts + 1.

    Raises:
        ValueError: a completion without routed experts, or with another ``[n <= Lp + Lr, L, K]`` shape.
    """
    width = layout.max_prompt_len + layout.max_tokens
    wire = torch.zeros(num_groups * group_size, width, routing.num_layers, routing.top_k, dtype=routing.dtype)
    for slot, group in slots.items():
        for j, completion in enumerate(group.completions.completions):
            routed = completion.routed_experts
            shape = None if routed is None else tuple(routed.shape)
            if shape is None or shape[0] > width or shape[1:] != (routing.num_layers, routing.top_k):
                raise ValueError(
                    f"group slot {slot} completion {j}: routed experts of shape {shape}, expected [n <= {width}, "
                    f"{routing.num_layers}, {routing.top_k}]; start the engine with routing replay"
                )
            wire[slot * group_size + j, : shape[0]] = routed.to(routing.dtype) + 1
    return wire


def attach_routed_experts(wire: torch.Tensor, groups: list[PromptCompletions]) -> None:
    """Set each completion's ``routed_experts`` (``[n, L, K]`` int16 ids) from the summed :func:`pack_routed_experts`.

    ``n`` is the row's recorded prefix (entries > 0); ``groups`` in row order (``unpack_rows``). Mutates them.
    """
    completions = [c for group in groups for c in group.completions]
    recorded = (wire[:, :, 0, 0] > 0).sum(dim=1).tolist()
    for completion, row, n in zip(completions, wire, recorded, strict=True):
        completion.routed_experts = (row[:n].to(torch.int32) - 1).to(torch.int16)


def raise_leader_failures(error: BaseException | None, *, group) -> None:
    """On every rank once any leader failed: raise the leaders' messages (each names its engine and setting).

    ``error``: this rank's failure, else None. Collectives: one ``all_gather_object`` on ``group``.

    Raises:
        RuntimeError: always, with every failed leader's rank and message (chained to ``error`` on a leader).
    """
    messages = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group=group)
    failed = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message is not None)
    raise RuntimeError(f"an engine leader's rollout failed, so every rank stops ({failed})") from error
