"""World-size and divisibility arithmetic of a GTPO run, checked before any process group exists.

Megatron-Core's and vLLM's rules: TP divides the attention heads and query groups, PP the layers, the vocabulary
is padded to a multiple of ``make_vocab_size_divisible_by * tp_size``, engine TP divides the heads and divides or is
a multiple of the KV heads, and ``num_prompts * group_size`` splits over DP ranks and then micro-batches. Each rule
returns its problems (empty when it holds); ``check_layout`` (``gtpo-plan``) and ``GTPOConfig.validate`` call them.
``separate`` engines (``plan/engines.py``) take GPUs outside the torchrun world, counted in ``--gpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gtpo_megatron.plan.architectures import Architecture
from gtpo_megatron.plan.engines import (
    Placement,
    engine_count_problems,
    engine_placements,
    engine_pool_gpus,
    engine_prompt_range,
    resolve_num_engines,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A layout that divides: sizes derived from the world size and the config.

    ``train_world_size`` is the torchrun world (``tp * pp * dp``; without the separate engines' GPUs);
    ``num_microbatches`` per DP rank per optimizer step; ``sequences_per_engine`` of the busiest engine.
    """

    world_size: int
    train_world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    engine_tp_size: int
    num_engines: int
    padded_vocab_size: int
    sequences_per_step: int
    sequences_per_dp_rank: int
    num_microbatches: int
    sequences_per_engine: int


def padded_vocab_size(vocab_size: int, *, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by * tp_size``."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_problems(arch: Architecture, *, tp_size: int, pp_size: int, pad_attention_heads: bool) -> list[str]:
    """Reasons Megatron cannot shard the model over ``tp_size`` x ``pp_size`` (padded heads: PP rule only)."""
    problems = []
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    tp_ok = [d for d in _divisors(heads) if groups % d == 0]
    if (heads % tp_size or groups % tp_size) and not pad_attention_heads:
        problems.append(
            f"parallel.tp_size={tp_size} must divide num_attention_heads={heads} and num_query_groups={groups} of "
            f"{arch.name}; use one of {tp_ok} or set model.pad_attention_heads=true"
        )
    if arch.num_layers % pp_size:
        problems.append(
            f"parallel.pp_size={pp_size} must divide num_layers={arch.num_layers} of {arch.name}; "
            f"use one of {_divisors(arch.num_layers)}"
        )
    return problems


def engine_problems(arch: Architecture, *, engine_tp_size: int) -> list[str]:
    """Reasons vLLM cannot shard the model over ``engine_tp_size`` GPUs (empty when it can)."""
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    if heads % engine_tp_size or (groups % engine_tp_size and engine_tp_size % groups):
        engine_ok = [d for d in _divisors(heads) if groups % d == 0 or d % groups == 0]
        return [
            f"rollout.engine_tp_size={engine_tp_size} must divide num_attention_heads={heads} and divide or be a "
            f"multiple of num_query_groups={groups} (vLLM); use one of {engine_ok}"
        ]
    return []


def smallest_world_size(*, tp_size: int, pp_size: int, ep_size: int = 1) -> int:
    """The fewest training ranks ``world_problems`` accepts: a multiple of ``tp * pp`` and of ``ep * pp``."""
    return pp_size * math.lcm(tp_size, ep_size)


def ep_sizes(stage_ranks: int, num_experts: int = 0) -> list[int]:
    """The ``parallel.ep_size`` values both EP rules accept: divisors of ``stage_ranks`` and of ``num_experts``.

    ``stage_ranks``: a pipeline stage's ranks; ``num_experts``: the model's experts (0: not known here).
    """
    return [d for d in _divisors(stage_ranks) if not num_experts or num_experts % d == 0]


def world_problems(
    train_world_size: int,
    *,
    tp_size: int,
    pp_size: int,
    described: str,
    launch: str,
    ep_size: int = 1,
    num_experts: int = 0,
) -> list[str]:
    """Reasons ``train_world_size`` ranks do not split into ``tp * pp`` replicas, or a stage's ranks into EP groups.

    ``ep_size``: the EP group size; ``num_experts``: the model's (0: unknown), so that a suggested ``ep_size``
    passes :func:`expert_problems` too; ``described``/``launch``: the message's wording.
    """
    if min(tp_size, pp_size, ep_size) < 1:
        return [f"parallel.tp_size/pp_size/ep_size={tp_size}/{pp_size}/{ep_size} must each be >= 1; use 1"]
    if train_world_size < 1 or train_world_size % (tp_size * pp_size):
        return [
            f"{described}, not a multiple of parallel.tp_size*parallel.pp_size={tp_size}*{pp_size} (tp_size*pp_size "
            f"must divide the world size); launch {launch} or change tp_size/pp_size"
        ]
    if train_world_size % (ep_size * pp_size):
        stage = train_world_size // pp_size
        return [
            f"parallel.ep_size={ep_size} must divide the {stage} ranks of a pipeline stage ({described}, "
            f"parallel.pp_size={pp_size}); use one of {ep_sizes(stage, num_experts)}"
        ]
    return []


def expert_problems(
    arch: Architecture, *, ep_size: int, tp_size: int, sequence_parallel: bool, stage_ranks: int | None = None
) -> list[str]:
    """Reasons Megatron cannot lay out the experts of ``arch`` (none for a dense model at ``ep_size`` 1).

    ``stage_ranks``: a pipeline stage's ranks, when known: a suggested ``ep_size`` divides them too (:func:`ep_sizes`).
    """
    experts = arch.num_experts
    if not experts:
        if ep_size == 1:
            return []
        return [f"parallel.ep_size={ep_size} but {arch.name} is a dense model (no experts); set parallel.ep_size=1"]
    problems = []
    if experts % ep_size:
        problems.append(
            f"parallel.ep_size={ep_size} must divide the {experts} experts of {arch.name}; use one of "
            f"{_divisors(experts) if stage_ranks is None else ep_sizes(stage_ranks, experts)}"
        )
    if tp_size > 1 and not sequence_parallel:
        problems.append(
            f"parallel.tp_size={tp_size} with the mixture-of-experts {arch.name} needs parallel.sequence_parallel=true "
            "(Megatron's MoE layer trains under tensor parallelism only with sequence parallelism); set it, or "
            "parallel.tp_size=1"
        )
    return problems


def batch_problems(*, num_prompts: int, group_size: int, dp_size: int, micro_batch_size: int) -> list[str]:
    """Reasons ``num_prompts * group_size`` sequences do not split over ``dp_size`` ranks and micro-batches."""
    batch = num_prompts * group_size
    if batch % dp_size:
        return [
            f"rollout.num_prompts*algorithm.group_size={num_prompts}*{group_size}={batch} must split evenly over "
            f"dp_size={dp_size}; use rollout.num_prompts={_next_prompts(num_prompts, group_size, dp_size)}"
        ]
    if (batch // dp_size) % micro_batch_size:
        return [
            f"optim.micro_batch_size={micro_batch_size} must divide the {batch // dp_size} sequences per "
            f"data-parallel rank; use one of {_divisors(batch // dp_size)}"
        ]
    return []


def raise_problems(problems: list[str]) -> None:
    """Raise one ``ValueError`` listing every problem (one line each), if there is any."""
    if problems:
        raise ValueError("layout does not divide:\n  - " + "\n  - ".join(problems))


def check_layout(
    arch: Architecture,
    *,
    world_size: int,
    tp_size: int,
    pp_size: int,
    engine_tp_size: int,
    placement: Placement,
    num_prompts: int,
    group_size: int,
    micro_batch_size: int,
    make_vocab_size_divisible_by: int,
    gpus_per_node: int = 8,
    pad_attention_heads: bool = False,
    num_engines: int | Literal["auto"] = "auto",
    num_engine_gpus: int | None = None,
    ep_size: int = 1,
    sequence_parallel: bool = False,
) -> Layout:
    """Check every divisibility rule (module docstring) and return the derived :class:`Layout`.

    Every keyword is the config field of the same name; ``world_size`` is ``--gpus`` (separate engines' GPUs
    included) and ``gpus_per_node`` bounds an engine (one node).

    Raises:
        ValueError: one line per broken rule, each naming the fields, their values and a fix.
    """
    pool = engine_pool_gpus(placement=placement, engine_tp_size=engine_tp_size, num_engine_gpus=num_engine_gpus)
    train_world = world_size - pool
    model_parallel = tp_size * pp_size
    need = f"{model_parallel}*k" + (f" + {pool}" if placement == "separate" else "")
    problems = model_problems(arch, tp_size=tp_size, pp_size=pp_size, pad_attention_heads=pad_attention_heads)
    problems += engine_problems(arch, engine_tp_size=engine_tp_size)
    stage = train_world // pp_size if train_world > 0 and train_world % (tp_size * pp_size) == 0 else None
    problems += expert_problems(
        arch, ep_size=ep_size, tp_size=tp_size, sequence_parallel=sequence_parallel, stage_ranks=stage
    )
    problems += world_problems(
        train_world,
        tp_size=tp_size,
        pp_size=pp_size,
        ep_size=ep_size,
        num_experts=arch.num_experts,
        launch=f"{need} GPUs",
        described=f"--gpus={world_size} leaves {train_world} training ranks",
    )
    if engine_tp_size > min(gpus_per_node, world_size):
        problems.append(
            f"rollout.engine_tp_size={engine_tp_size} exceeds the {min(gpus_per_node, world_size)} GPUs the engine can "
            f"use (one node of --gpus-per-node={gpus_per_node}, at most --gpus={world_size}); lower it"
        )
    dp = max(train_world // model_parallel, 1)
    batch = num_prompts * group_size
    problems += batch_problems(
        num_prompts=num_prompts, group_size=group_size, dp_size=dp, micro_batch_size=micro_batch_size
    )
    engines = resolve_num_engines(
        num_engines, placement=placement, train_world_size=train_world, engine_tp_size=engine_tp_size,
        num_engine_gpus=num_engine_gpus, accelerator=True,
    )  # fmt: skip
    problems += engine_count_problems(
        engines, placement=placement, train_world_size=train_world, engine_tp_size=engine_tp_size, pool_gpus=pool
    )
    if not problems and placement == "colocated":  # separate engines are placed at start-up (torchrun's nodes)
        problems += _colocated_problems(engines, engine_tp_size, train_world, ranks_per_node=gpus_per_node)
    raise_problems(problems)
    return Layout(
        world_size=world_size,
        train_world_size=train_world,
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=dp,
        engine_tp_size=engine_tp_size,
        num_engines=engines,
        padded_vocab_size=padded_vocab_size(
            arch.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
        ),
        sequences_per_step=batch,
        sequences_per_dp_rank=batch // dp,
        num_microbatches=batch // dp // micro_batch_size,
        sequences_per_engine=len(engine_prompt_range(num_prompts, num_engines=engines, index=0)) * group_size,
    )


def _colocated_problems(num_engines: int, engine_tp: int, train_world: int, *, ranks_per_node: int) -> list[str]:
    """Why colocated engines cannot be placed (an engine's GPUs on two nodes); empty when they can."""
    try:
        engine_placements(
            placement="colocated", num_engines=num_engines, engine_tp_size=engine_tp, train_world_size=train_world,
            ranks_per_node=min(ranks_per_node, train_world), pool_gpus=0, accelerator=True,
        )  # fmt: skip
    except ValueError as err:
        return [str(err)]
    return []


def _next_prompts(num_prompts: int, group_size: int, dp_size: int) -> int:
    """Smallest prompt count >= ``num_prompts`` whose batch splits over ``dp_size`` ranks."""
    prompts = num_prompts
    while (prompts * group_size) % dp_size:
        prompts += 1
    return prompts


def row_shard(num_rows: int, *, rank: int, size: int) -> slice:
    """Rows ``[rank * B/size, (rank + 1) * B/size)`` of a ``B``-row step batch: one data-parallel rank's share.

    ``parallel.all_gather_rows`` puts the shares back together in rank order.

    Raises:
        ValueError: ``size`` does not divide ``num_rows``.
    """
    if num_rows % size:
        raise ValueError(f"batch of {num_rows} rows does not split over dp_size={size}; see GTPOConfig.validate")
    share = num_rows // size
    return slice(rank * share, (rank + 1) * share)
