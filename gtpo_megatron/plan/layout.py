"""World-size and divisibility arithmetic of a GTPO run, checked before any process group exists.

The rules are Megatron-Core's and vLLM's: TP must divide the attention heads and the query groups (Megatron
``TransformerConfig``), PP must divide the layers, the vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp_size`` (Megatron's ``_vocab_size_with_padding``), vLLM's engine TP must divide
the attention heads and either divide the KV heads or be a multiple of them, and the rollout batch
``num_prompts * group_size`` must split evenly over data-parallel ranks and then into micro-batches (the same rule
as ``GTPOConfig.validate``). The trainer runs one vLLM engine, owned by global rank 0 (``trainer.py``), with
``engine_tp_size`` GPUs of one node: ``colocated`` puts it on the first training GPUs, ``separate`` on GPUs of its
own outside the torchrun world, so that ``--gpus`` counts the training GPUs plus the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gtpo_megatron.plan.architectures import Architecture


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A layout that divides: sizes derived from the world size and the config.

    Attributes:
        world_size: all GPUs of the job.
        train_world_size: GPUs that train, the torchrun world (all of them when colocated, all but the engine's
            when separate).
        tp_size, pp_size, dp_size: training parallel sizes, ``tp * pp * dp == train_world_size``.
        engine_tp_size: vLLM tensor-parallel size.
        num_engines: vLLM engines sharing the rollout batch (1: rank 0's engine).
        padded_vocab_size: Megatron's padded vocabulary ``V``.
        sequences_per_step: ``num_prompts * group_size``.
        sequences_per_dp_rank: sequences one data-parallel rank trains on per step.
        num_microbatches: micro-batches per data-parallel rank per optimizer step.
        sequences_per_engine: rollout sequences one engine decodes (ceil over engines).
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


def _model_problems(arch: Architecture, tp: int, pp: int, engine_tp: int, pad_heads: bool) -> list[str]:
    """Reasons the model cannot be sharded this way (empty when it can).

    With ``pad_heads`` (``model.pad_attention_heads``) Megatron pads the KV groups to a multiple of ``tp`` with
    zero heads, so only the pipeline and engine rules apply to the training layout.
    """
    problems = []
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    tp_ok = [d for d in _divisors(heads) if groups % d == 0]
    if (heads % tp or groups % tp) and not pad_heads:
        problems.append(
            f"parallel.tp_size={tp} must divide num_attention_heads={heads} and num_query_groups={groups} of "
            f"{arch.name}; use one of {tp_ok} or set model.pad_attention_heads=true"
        )
    if arch.num_layers % pp:
        problems.append(
            f"parallel.pp_size={pp} must divide num_layers={arch.num_layers} of {arch.name}; "
            f"use one of {_divisors(arch.num_layers)}"
        )
    if heads % engine_tp or (groups % engine_tp and engine_tp % groups):
        engine_ok = [d for d in _divisors(heads) if groups % d == 0 or d % groups == 0]
        problems.append(
            f"rollout.engine_tp_size={engine_tp} must divide num_attention_heads={heads} and divide or be a "
            f"multiple of num_query_groups={groups} (vLLM); use one of {engine_ok}"
        )
    return problems


def check_layout(
    arch: Architecture,
    *,
    world_size: int,
    tp_size: int,
    pp_size: int,
    engine_tp_size: int,
    placement: Literal["colocated", "separate"],
    num_prompts: int,
    group_size: int,
    micro_batch_size: int,
    make_vocab_size_divisible_by: int,
    gpus_per_node: int = 8,
    pad_attention_heads: bool = False,
) -> Layout:
    """Check every divisibility rule (module docstring) and return the derived :class:`Layout`.

    Args:
        arch: model dimensions.
        world_size: GPUs of the whole job (``--gpus``), the engine's included when ``placement="separate"``.
        tp_size, pp_size: ``parallel.tp_size`` and ``parallel.pp_size``.
        engine_tp_size: ``rollout.engine_tp_size``.
        placement: ``rollout.placement``.
        num_prompts, group_size: ``rollout.num_prompts`` and ``algorithm.group_size``.
        micro_batch_size: ``optim.micro_batch_size``.
        make_vocab_size_divisible_by: ``model.make_vocab_size_divisible_by``.
        gpus_per_node: GPUs of one node (the engine stays within one node).
        pad_attention_heads: ``model.pad_attention_heads`` (zero KV groups pad the heads to a multiple of tp).

    Raises:
        ValueError: one line per broken rule, each naming the fields, their values and a fix.
    """
    train_world = world_size - (engine_tp_size if placement == "separate" else 0)
    problems = _model_problems(arch, tp_size, pp_size, engine_tp_size, pad_attention_heads)
    model_parallel = tp_size * pp_size
    if train_world < 1 or train_world % model_parallel:
        need = f"{model_parallel}*k" + (f" + {engine_tp_size}" if placement == "separate" else "")
        problems.append(
            f"--gpus={world_size} leaves {train_world} training ranks, not a multiple of parallel.tp_size*"
            f"parallel.pp_size={tp_size}*{pp_size}; launch {need} GPUs or change tp_size/pp_size"
        )
    if engine_tp_size > min(gpus_per_node, world_size):
        problems.append(
            f"rollout.engine_tp_size={engine_tp_size} exceeds the {min(gpus_per_node, world_size)} GPUs the engine can "
            f"use (one node of --gpus-per-node={gpus_per_node}, at most --gpus={world_size}); lower it"
        )
    dp = max(train_world // model_parallel, 1)
    batch = num_prompts * group_size
    if batch % dp:
        problems.append(
            f"rollout.num_prompts*algorithm.group_size={num_prompts}*{group_size}={batch} must split evenly over "
            f"dp_size={dp}; use rollout.num_prompts={_next_prompts(num_prompts, group_size, dp)}"
        )
    elif (batch // dp) % micro_batch_size:
        problems.append(
            f"optim.micro_batch_size={micro_batch_size} must divide the {batch // dp} sequences per data-parallel "
            f"rank; use one of {_divisors(batch // dp)}"
        )
    if problems:
        raise ValueError("layout does not divide:\n  - " + "\n  - ".join(problems))
    num_engines = 1
    return Layout(
        world_size=world_size,
        train_world_size=train_world,
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=dp,
        engine_tp_size=engine_tp_size,
        num_engines=num_engines,
        padded_vocab_size=padded_vocab_size(
            arch.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
        ),
        sequences_per_step=batch,
        sequences_per_dp_rank=batch // dp,
        num_microbatches=batch // dp // micro_batch_size,
        sequences_per_engine=-(-batch // num_engines),
    )


def _next_prompts(num_prompts: int, group_size: int, dp_size: int) -> int:
    """Smallest prompt count >= ``num_prompts`` whose batch splits over ``dp_size`` ranks."""
    prompts = num_prompts
    while (prompts * group_size) % dp_size:
        prompts += 1
    return prompts
