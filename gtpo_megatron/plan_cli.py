"""``gtpo-plan``: check a recipe's layout and per-GPU memory for a cluster before launching it (no GPU needed).

Usage::

    gtpo-plan --config configs/llama3.1-70b_math_gtpo_64gpu.yaml --gpus 64 --gpu-mem 80 [--sync-bandwidth-gbps 400]
              [--reserve-gib 4] [key=value overrides]

Exit status: 0 when the layout divides and every phase fits (the per-GPU table is printed); 2 with the reasons,
each naming the fields, their values and a fix, when it does not. The estimates are those of
:mod:`gtpo_megatron.plan.memory`; ``--gpu-mem`` is in GiB and ``--reserve-gib`` of it is kept back for the CUDA
context, NCCL buffers and allocator fragmentation.

Phases. Colocated runs alternate: while vLLM generates, the trainer's weights, gradients and optimizer states stay
resident next to the engine's ``rollout.gpu_memory_utilization`` share of the GPU; while the policy trains, the
engine sleeps (weights offloaded, KV cache freed) and activations plus the log-prob working set take its place.
Separate runs put the engine on its own GPUs.

Step time. ``plan.overlap``'s first-order model compares the colocated sync step on every GPU with the best split
between training and engine GPUs for ``rollout.mode: async`` (``--gpu-tflops``, ``--gpu-hbm-tbps``, ``--mfu``).
Weight sync: the path a GPU run takes (``config/weight_sync.py``) on the sync line, both paths on the links line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from gtpo_megatron.config import GTPOConfig, load_config
from gtpo_megatron.config.weight_sync import run_weight_sync, with_weight_sync
from gtpo_megatron.megatron_adapter.settings import PolicySettings, policy_settings
from gtpo_megatron.megatron_adapter.validation import validate_config
from gtpo_megatron.plan.architectures import Architecture, resolve_architecture
from gtpo_megatron.plan.layout import Layout, check_layout
from gtpo_megatron.plan.memory import (
    DTYPE_BYTES,
    StageMemory,
    TrainingShape,
    activation_bytes,
    engine_weight_bytes,
    estimate_stage,
    kv_cache_bytes_per_token,
    logprob_working_set_bytes,
    stage_expert_params,
    stage_lora_params,
    weight_sync_seconds,
)
from gtpo_megatron.plan.micro_batches import micro_batches_at_full_length
from gtpo_megatron.plan.overlap import Hardware, StepWork, best_split, sync_step
from gtpo_megatron.plan.sync_links import sync_links

GIB = 2**30
FILES_GBPS = 16.0
"""Assumed throughput of one pass of the ``files`` weight sync through ``/dev/shm`` (2 GB/s; measured 0.28 GB/s for
SmolLM2 on the 2-core CPU machine, write and reload together)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineMemory:
    """Bytes on one GPU of a vLLM engine: its memory budget, weights, KV capacity and the batch's KV demand."""

    budget: int
    weights: int
    kv_per_token: int
    kv_capacity: int
    kv_for_batch: int


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gtpo-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--gpus", type=int, required=True, help="world size: GPUs of the whole job")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=4.0,
        help="GiB per GPU kept for CUDA context, NCCL and fragmentation (default 4)",
    )
    parser.add_argument(
        "--sync-bandwidth-gbps",
        type=float,
        default=400.0,
        help="link bandwidth of one weight sync in gigabit/s (default 400: one NDR InfiniBand port)",
    )
    parser.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100/H200)")
    parser.add_argument("--gpu-hbm-tbps", type=float, default=3.35, help="HBM TB/s of one GPU (H100; H200: 4.8)")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of --gpu-tflops reached (step time model)")
    frac_help = "mean completion / rollout.max_tokens (partial rollouts' step time)"
    parser.add_argument("--mean-completion-frac", type=float, default=0.5, help=frac_help)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp_size=8")
    return parser.parse_intermixed_args(argv)


def _check_args(args: argparse.Namespace) -> None:
    """The numeric flags are positive and ``--reserve-gib`` leaves some memory; ValueError naming flag and fix."""
    checks = [
        (args.gpus >= 1, "--gpus", args.gpus, "must be >= 1", "give the job's total GPU count, e.g. --gpus 8"),
        (args.gpu_mem > 0, "--gpu-mem", args.gpu_mem, "must be > 0 GiB", "e.g. --gpu-mem 80 (A100/H100) or 141 (H200)"),
        (args.gpus_per_node >= 1, "--gpus-per-node", args.gpus_per_node, "must be >= 1", "e.g. --gpus-per-node 8"),
        (
            0 <= args.reserve_gib < args.gpu_mem,
            "--reserve-gib",
            args.reserve_gib,
            f"must be in [0, --gpu-mem={args.gpu_mem:g})",
            "keep the default 4",
        ),
        (args.gpu_tflops > 0, "--gpu-tflops", args.gpu_tflops, "must be > 0", "e.g. 989 (H100/H200 bf16)"),
        (args.gpu_hbm_tbps > 0, "--gpu-hbm-tbps", args.gpu_hbm_tbps, "must be > 0", "e.g. 3.35 (H100) or 4.8 (H200)"),
        (0 < args.mfu <= 1, "--mfu", args.mfu, "must be in (0, 1]", "keep the default 0.4"),
        (
            0 < args.mean_completion_frac <= 1,
            "--mean-completion-frac",
            args.mean_completion_frac,
            "must be in (0, 1]",
            "keep the default 0.5",
        ),
        (
            args.sync_bandwidth_gbps > 0,
            "--sync-bandwidth-gbps",
            args.sync_bandwidth_gbps,
            "must be > 0",
            "keep the default 400 (one NDR InfiniBand port)",
        ),
    ]
    for ok, flag, value, rule, fix in checks:
        if not ok:
            raise ValueError(f"{flag}={value:g}: {rule}; {fix}")


def training_shape(
    settings: PolicySettings, layout: Layout, *, seq_length: int, reference_weights: bool = False
) -> TrainingShape:
    """The planner's :class:`TrainingShape` of sequences of ``seq_length`` tokens on a checked :class:`Layout`.

    Every Megatron-side number comes from the policy's ``PolicySettings``, the object Megatron is built from;
    ``reference_weights``: a frozen KL reference stage stays on the GPU (``kl_coef > 0`` without offload).
    """
    budget = settings.token_budget
    return TrainingShape(
        tp_size=layout.tp_size,
        pp_size=layout.pp_size,
        dp_size=layout.dp_size,
        micro_batch_size=settings.micro_batch_size if budget is None else 1,
        seq_length=seq_length,
        num_microbatches=layout.num_microbatches
        if budget is None
        else micro_batches_at_full_length(layout.sequences_per_dp_rank, seq_length, budget),
        max_tokens_per_micro_batch=None if budget is None else budget.max_tokens,
        param_bytes=DTYPE_BYTES[settings.model.params_dtype],
        sequence_parallel=settings.sequence_parallel,
        distributed_optimizer=settings.parallel.use_distributed_optimizer,
        recompute=settings.model.recompute,
        logprob_chunk_size=settings.logprob_chunk_size,
        fp32_output_layer=settings.model.fp32_output_layer,
        reference_weights=reference_weights,
        ep_size=settings.ep_size,
        lora_rank=settings.model.lora.rank,
        lora_projections=settings.model.lora.projections,
    )


def engine_memory(
    cfg: GTPOConfig, arch: Architecture, layout: Layout, *, gpu_mem_bytes: int, seq_length: int
) -> EngineMemory:
    """vLLM's share of one engine GPU for the rollout batch (KV cache in the engine's weight dtype)."""
    dtype = cfg.engine_dtype
    budget = int(cfg.rollout.gpu_memory_utilization * gpu_mem_bytes)
    weights = engine_weight_bytes(arch, engine_tp_size=layout.engine_tp_size, param_bytes=DTYPE_BYTES[dtype])
    per_token = kv_cache_bytes_per_token(arch, engine_tp_size=layout.engine_tp_size, kv_bytes=DTYPE_BYTES[dtype])
    return EngineMemory(
        budget=budget,
        weights=weights,
        kv_per_token=per_token,
        kv_capacity=max(budget - weights, 0),
        kv_for_batch=layout.sequences_per_engine * seq_length * per_token,
    )


def training_fixes(shape: TrainingShape) -> str:
    """The memory savers this layout does not use yet, as overrides to try, most effective first."""
    fixes = []
    if shape.dp_size > 1 and not shape.distributed_optimizer:
        fixes.append("parallel.use_distributed_optimizer=true")
    if shape.recompute != "full":
        fixes.append("model.recompute=full")
    if shape.tp_size > 1 and not shape.sequence_parallel:
        fixes.append("parallel.sequence_parallel=true")
    if shape.logprob_chunk_size is None:
        fixes.append("algorithm.logprob_chunk_size=1024")
    if shape.micro_batch_size > 1:
        fixes.append("a smaller optim.micro_batch_size")
    if (shape.max_tokens_per_micro_batch or 0) > shape.seq_length:
        fixes.append(f"optim.max_tokens_per_micro_batch={shape.seq_length} (one full-length sequence)")
    return "try " + ", ".join(fixes + ["more GPUs or a larger parallel.tp_size*parallel.pp_size"])


def offload_train_state(cfg: GTPOConfig) -> bool:
    """``rollout.offload_train_state``: gradients and optimizer states leave the GPU while vLLM generates.

    Megatron-Core provides the calls for RL (``DistributedDataParallel.offload_grad_buffers`` and
    ``MegatronOptimizer.offload_to_cpu``), which ``Trainer`` calls around the rollout phase when it is set.
    """
    return cfg.rollout.offload_train_state


def rollout_resident(stage: StageMemory, offload: bool) -> int:
    """Trainer bytes that stay on a colocated GPU while vLLM generates (only the weights when offloading).

    KL reference weights stay in both cases (``algorithm.kl_reference_offload`` keeps them off the GPU instead).
    """
    return stage.weights + stage.reference if offload else stage.static


def fit_problems(
    cfg: GTPOConfig, shape: TrainingShape, stages: list[StageMemory], engine: EngineMemory, *, gpu_mem: int, usable: int
) -> list[str]:
    """Reasons the run does not fit in ``usable`` of ``gpu_mem`` bytes per GPU (empty when it fits)."""
    problems = []
    worst = max(stages, key=lambda m: m.total)
    if worst.total > usable:
        problems.append(
            f"training phase needs {worst.total / GIB:.1f} GiB on pipeline stage {worst.stage} > "
            f"{usable / GIB:.1f} GiB usable; {training_fixes(shape)}"
        )
    util = cfg.rollout.gpu_memory_utilization
    seq_length = shape.seq_length
    one_sequence = seq_length * engine.kv_per_token
    resident = max(rollout_resident(m, offload_train_state(cfg)) for m in stages)
    if cfg.rollout.placement == "colocated" and resident + engine.budget > usable:
        if usable - resident < engine.weights + one_sequence:
            fix = (
                "vLLM's weights and one sequence's KV cache do not fit next to it: set "
                "rollout.offload_train_state=true (grads and optimizer states leave the GPU while vLLM "
                "generates), use more GPUs or raise rollout.engine_tp_size"
            )
        else:
            fix = f"lower rollout.gpu_memory_utilization to <= {(usable - resident) / gpu_mem:.2f}"
        problems.append(
            f"rollout phase: trainer state {resident / GIB:.1f} GiB + vLLM budget rollout.gpu_memory_utilization="
            f"{util} ({engine.budget / GIB:.1f} GiB) > {usable / GIB:.1f} GiB usable; {fix}"
        )
    if cfg.rollout.placement == "separate" and engine.budget > usable:
        problems.append(
            f"rollout.gpu_memory_utilization={util} gives vLLM {engine.budget / GIB:.1f} GiB > "
            f"{usable / GIB:.1f} GiB usable; use <= {usable / gpu_mem:.2f}"
        )
    if engine.weights + one_sequence > engine.budget:
        problems.append(
            f"vLLM: weights {engine.weights / GIB:.1f} GiB + KV cache of one {seq_length}-token sequence "
            f"{one_sequence / GIB:.2f} GiB exceed rollout.gpu_memory_utilization={util} "
            f"({engine.budget / GIB:.1f} GiB); raise rollout.gpu_memory_utilization or rollout.engine_tp_size"
        )
    return problems


def _row(label: str, values: list[float | str]) -> str:
    cells = [v if isinstance(v, str) else f"{v / GIB:10.2f}" for v in values]
    return f"{label:<34}" + "".join(f"{c:>12}" for c in cells)


def format_table(cfg: GTPOConfig, stages: list[StageMemory], engine: EngineMemory, *, unchunked: int) -> str:
    """Per-GPU memory table (GiB): one column per distinct pipeline stage, plus the engine GPU when separate."""
    separate = cfg.rollout.placement == "separate"
    pad = [""] if separate else []

    def engine_cells(value: int) -> list[float | str]:
        return [""] * len(stages) + [value] if separate else [value] * len(stages)

    lines = [
        _row("per-GPU memory (GiB)", [f"stage {m.stage}" for m in stages] + (["engine GPU"] if separate else [])),
        _row("weights", [m.weights for m in stages] + pad),
        _row("gradients (fp32 main grads)", [m.grads for m in stages] + pad),
        _row("optimizer (Adam + fp32 master)", [m.optimizer for m in stages] + pad),
        *([_row("KL reference weights", [m.reference for m in stages] + pad)] if stages[0].reference else []),
        _row("activations", [m.activations for m in stages] + pad),
        _row(f"logits/entropy (chunk={cfg.algorithm.logprob_chunk_size})", [m.logits for m in stages] + pad),
        _row("  same, unchunked", [unchunked if m.logits else 0 for m in stages] + pad),
        _row("training phase total", [m.total for m in stages] + pad),
        _row("vLLM weights (engine TP shard)", engine_cells(engine.weights)),
        _row("vLLM KV-cache capacity", engine_cells(engine.kv_capacity)),
    ]
    if separate:
        lines.append(_row("engine GPU total (vLLM budget)", engine_cells(engine.budget)))
    else:
        offload = offload_train_state(cfg)
        lines.append(_row("rollout phase total", [rollout_resident(m, offload) + engine.budget for m in stages]))
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> tuple[int, str]:
    """Plan a run; return ``(exit_status, text)`` (0: fits, 2: does not divide or does not fit)."""
    args = _parse_args(argv)
    try:
        _check_args(args)
        cfg = load_config(args.config, list(args.overrides))
        settings = policy_settings(cfg)  # what the run builds Megatron from: the plan reports on the same values
        arch = resolve_architecture(cfg.model.name_or_path)
        layout = check_layout(
            arch, world_size=args.gpus, tp_size=settings.tp_size, pp_size=settings.pp_size,
            engine_tp_size=cfg.rollout.engine_tp_size, placement=cfg.rollout.placement,
            num_prompts=cfg.rollout.num_prompts, group_size=cfg.algorithm.group_size,
            micro_batch_size=settings.micro_batch_size if settings.token_budget is None else 1,
            make_vocab_size_divisible_by=settings.model.make_vocab_size_divisible_by,
            gpus_per_node=args.gpus_per_node, pad_attention_heads=settings.model.pad_attention_heads,
            num_engines=cfg.rollout.num_engines, num_engine_gpus=cfg.rollout.num_engine_gpus,
            ep_size=settings.ep_size, sequence_parallel=settings.sequence_parallel,
        )  # fmt: skip
        validate_config(cfg, layout.train_world_size, check_registries=False)  # the torchrun world
        sync = run_weight_sync(cfg, accelerator=True)  # the path a GPU run takes (auto resolved, as at start-up)
        cfg = with_weight_sync(cfg, sync)
    except ValueError as err:
        return 2, f"gtpo-plan: {args.config} on {args.gpus} GPUs: {err}"
    shape = training_shape(
        settings,
        layout,
        seq_length=cfg.rollout.max_prompt_len + cfg.rollout.max_tokens,
        reference_weights=cfg.algorithm.kl_coef > 0
        and not cfg.algorithm.kl_reference_offload
        and not cfg.model.lora.enabled,  # LoRA's reference is the policy's base, adapters off
    )
    gpu_mem = int(args.gpu_mem * GIB)
    stages = [estimate_stage(arch, shape, padded_vocab_size=layout.padded_vocab_size, stage=s)
              for s in sorted({0, layout.pp_size - 1})]  # fmt: skip
    engine = engine_memory(cfg, arch, layout, gpu_mem_bytes=gpu_mem, seq_length=shape.seq_length)
    unchunked = logprob_working_set_bytes(
        layout.padded_vocab_size // layout.tp_size, tokens=shape.micro_batch_tokens,
        hidden_size=arch.hidden_size, param_bytes=shape.param_bytes, chunk_size=None,
        fp32_output_layer=shape.fp32_output_layer,
    )  # fmt: skip
    usable = gpu_mem - int(args.reserve_gib * GIB)
    problems = fit_problems(cfg, shape, stages, engine, gpu_mem=gpu_mem, usable=usable)
    text = "\n".join([_summary(cfg, arch, layout, shape, args), format_table(cfg, stages, engine, unchunked=unchunked),
                      _rollout_summary(engine, layout, shape, arch, args),
                      _sync_summary(cfg, arch, layout, args) + ("" if _adapter_bytes(cfg, arch) else
                                                                 f"; {sync.describe()}"),
                      _links_summary(cfg, arch, layout, args),
                      _overlap_summary(cfg, arch, layout, args)])  # fmt: skip
    if problems:
        return 2, text + "\n\ngtpo-plan: does not fit:\n  - " + "\n  - ".join(problems)
    return 0, text + f"\n\nfits: every phase is within {usable / GIB:.1f} GiB usable of {args.gpu_mem:g} GiB per GPU"


def _summary(
    cfg: GTPOConfig, arch: Architecture, layout: Layout, shape: TrainingShape, args: argparse.Namespace
) -> str:
    return (
        f"{arch.name}: {arch.total_params() / 1e9:.2f}B parameters, {arch.num_layers} layers, "
        f"{arch.num_attention_heads} heads / {arch.num_query_groups} query groups, vocab {arch.vocab_size} -> "
        f"padded {layout.padded_vocab_size}\n"
        + _experts_line(cfg, arch, layout, shape)
        + f"layout on {args.gpus} GPUs: train {layout.train_world_size} = tp {layout.tp_size} x pp {layout.pp_size} x "
        f"dp {layout.dp_size}{f', ep {shape.ep_size}' if shape.ep_size > 1 else ''} "
        f"(sequence_parallel={shape.sequence_parallel}, distributed_optimizer="
        f"{shape.distributed_optimizer}, recompute={shape.recompute}); vLLM {layout.num_engines} x engine tp "
        f"{layout.engine_tp_size} ({cfg.rollout.placement})\n"
        f"batch: {layout.sequences_per_step} sequences/step = {cfg.rollout.num_prompts} prompts x "
        f"{cfg.algorithm.group_size}, {layout.sequences_per_dp_rank} per dp rank = "
        f"{_micro_batch_words(cfg, shape)}\n"
        f"activations from {shape.micro_batch_tokens} tokens a micro-batch, stage 0: "
        + ", ".join(
            f"model.recompute={mode} {activation_bytes(arch, replace(shape, recompute=mode), stage=0) / GIB:.2f} GiB"
            for mode in ("none", "full")
        )  # fmt: skip
        + "\n"
    )


def _experts_line(cfg: GTPOConfig, arch: Architecture, layout: Layout, shape: TrainingShape) -> str:
    """The MoE line of the summary: the trainer's and the engines' expert layouts (empty for a dense model).

    vLLM's engines keep every expert of every layer and split each expert's FFN over their tensor parallelism
    (vLLM's default; its ``enable_expert_parallel`` is not driven here).
    """
    if not arch.num_experts:
        return ""
    per_rank = arch.num_experts // shape.ep_size
    expert_gib = stage_expert_params(arch, pp_size=shape.pp_size, ep_size=shape.ep_size) * shape.param_bytes / GIB
    engine_bytes = stage_expert_params(arch, pp_size=1, ep_size=1) * DTYPE_BYTES[cfg.engine_dtype]
    engine_gib = engine_bytes / layout.engine_tp_size / GIB
    return (
        f"experts: {arch.num_experts} a layer, {arch.top_k} active ({arch.active_params() / 1e9:.2f}B active "
        f"parameters: the FLOPs below), ep {shape.ep_size}: {per_rank} a rank, {expert_gib:.2f} GiB of expert "
        f"weights a GPU; engines: all {arch.num_experts} a layer, each split {layout.engine_tp_size} ways by engine "
        f"tp, {engine_gib:.2f} GiB of expert weights a GPU\n"
    )


def _micro_batch_words(cfg: GTPOConfig, shape: TrainingShape) -> str:
    if shape.max_tokens_per_micro_batch is None:
        return f"{shape.num_microbatches} micro-batches of {shape.micro_batch_size} x {shape.seq_length} tokens"
    how = "packed" if cfg.optim.packing else "padded to each one's longest"
    return (
        f"at most {shape.num_microbatches} micro-batches (every sequence {shape.seq_length} tokens) of <= "
        f"{shape.max_tokens_per_micro_batch} tokens (optim.max_tokens_per_micro_batch, {how})"
    )


def _rollout_summary(
    engine: EngineMemory, layout: Layout, shape: TrainingShape, arch: Architecture, args: argparse.Namespace
) -> str:
    concurrent = engine.kv_capacity // max(engine.kv_per_token * shape.seq_length, 1)
    return (
        f"\nvLLM KV cache: {engine.kv_per_token / 1024:.1f} KiB/token/GPU; {layout.sequences_per_engine} rollout "
        f"sequences per engine need {engine.kv_for_batch / GIB:.2f} GiB, capacity {engine.kv_capacity / GIB:.2f} "
        f"GiB holds {concurrent} full-length sequences at once"
        + ("" if concurrent >= layout.sequences_per_engine else " (vLLM queues the rest: slower, not an error)")
    )


def _links(cfg: GTPOConfig, arch: Architecture, layout: Layout, args: argparse.Namespace):
    """``plan.sync_links`` of this layout at ``--sync-bandwidth-gbps``."""
    return sync_links(
        arch.total_params() * DTYPE_BYTES[cfg.engine_dtype], train_ranks=layout.train_world_size,
        num_engines=layout.num_engines, engine_tp_size=layout.engine_tp_size, bandwidth_gbps=args.sync_bandwidth_gbps,
    )  # fmt: skip


def _sync_seconds(cfg: GTPOConfig, arch: Architecture, layout: Layout, args: argparse.Namespace) -> float:
    """Seconds of one weight sync of ``rollout.weight_sync`` (the ``files`` path: write, then re-read)."""
    nbytes = DTYPE_BYTES[cfg.engine_dtype]
    if _adapter_bytes(cfg, arch):
        return _adapter_bytes(cfg, arch) * 8 / (args.sync_bandwidth_gbps * 1e9)
    if cfg.rollout.weight_sync == "files":
        return 2 * weight_sync_seconds(arch, param_bytes=nbytes, bandwidth_gbps=FILES_GBPS)
    if cfg.rollout.weight_sync == "sharded":
        return _links(cfg, arch, layout, args)["sharded"].seconds
    return weight_sync_seconds(arch, param_bytes=nbytes, bandwidth_gbps=args.sync_bandwidth_gbps)


def _links_summary(cfg: GTPOConfig, arch: Architecture, layout: Layout, args: argparse.Namespace) -> str:
    """The busiest link of each weight-sync path side by side (``plan/sync_links.py``)."""
    links = _links(cfg, arch, layout, args)
    parts = [
        f"{name} {link.sender_bytes / 1e9:.1f} GB out of the busiest sender, {link.receiver_bytes / 1e9:.1f} GB into "
        f"each worker, {link.seconds:.2f} s"
        for name, link in links.items()
    ]
    return (
        f"weight sync links at {args.sync_bandwidth_gbps:g} Gbit/s ({layout.train_world_size} training ranks, "
        f"{layout.num_engines} engines x TP {layout.engine_tp_size}): "
        + "; ".join(parts)
        + " (sharded: each worker receives only its engine-TP slice)"
    )


def _overlap_summary(cfg: GTPOConfig, arch: Architecture, layout: Layout, args: argparse.Namespace) -> str:
    """Sync (colocated) against async (the best separate split) steps of the whole job (``plan.overlap``)."""
    dtype = cfg.engine_dtype
    hw = Hardware(peak_tflops=args.gpu_tflops, hbm_tbps=args.gpu_hbm_tbps, mfu=args.mfu)
    work = StepWork(
        sequences=layout.sequences_per_step, seq_length=cfg.rollout.max_prompt_len + cfg.rollout.max_tokens,
        completion_tokens=cfg.rollout.max_tokens, weight_bytes=arch.total_params() * DTYPE_BYTES[dtype],
        kv_bytes_per_token=kv_cache_bytes_per_token(arch, engine_tp_size=1, kv_bytes=DTYPE_BYTES[dtype]),
        engine_tp_size=layout.engine_tp_size,
    )  # fmt: skip
    streamed = work  # async with partial rollouts: the mean completion sets generation (plan.overlap)
    if cfg.rollout.partial_rollouts:
        mean = args.mean_completion_frac * cfg.rollout.max_tokens
        in_flight = 1 + cfg.rollout.max_staleness
        streamed = replace(work, mean_completion_tokens=mean, batches_in_flight=in_flight)
    sync_s = _sync_seconds(cfg, arch, layout, args)
    sync = sync_step(arch, work, hw, gpus=args.gpus, sync_s=sync_s)
    best = best_split(arch, streamed, hw, gpus=args.gpus, train_multiple=layout.tp_size * layout.pp_size, sync_s=sync_s)
    text = (
        f"step time model ({args.mfu:g} of {args.gpu_tflops:g} TFLOP/s, {args.gpu_hbm_tbps:g} TB/s; "
        f"gtpo_megatron/plan/overlap.py): sync colocated on {args.gpus} GPUs: generate {sync.generate_s:.0f} s + "
        f"train {sync.train_s:.0f} s + sync {sync_s:.1f} s = {sync.step_s:.0f} s"
    )
    if best is None:
        return text + "; async: no split of the GPUs between training and engines"
    return text + (
        f"; async (rollout.placement=separate, rollout.mode=async) with {best.train_gpus} training + "
        f"{best.engine_gpus} engine GPUs (rollout.num_engine_gpus={best.engine_gpus}): max(generate "
        f"{best.generate_s:.0f} s, train + sync {best.train_s + best.sync_s:.0f} s) = {best.step_s:.0f} s, "
        f"{sync.step_s / best.step_s:.2f}x"
        + _partial_note(cfg, args, streamed)
        + ("" if best.step_s < sync.step_s else ": keep rollout.mode=sync, generation is too short to hide training")
    )


def _partial_note(cfg: GTPOConfig, args: argparse.Namespace, streamed: StepWork) -> str:
    """What the async step assumed of partial rollouts ("" without them)."""
    if not cfg.rollout.partial_rollouts:
        return ""
    return (
        f" (partial rollouts: mean completion {args.mean_completion_frac:g} x rollout.max_tokens, "
        f"{streamed.batches_in_flight} batches streamed)"
    )


def _adapter_bytes(cfg: GTPOConfig, arch: Architecture) -> int:
    """Bytes of the whole model's adapters in the parameter dtype: one ``rollout.lora_sync=adapter`` sync (else 0)."""
    lora = cfg.model.lora
    if not (lora.enabled and cfg.rollout.lora_sync == "adapter"):
        return 0
    params = stage_lora_params(arch, rank=lora.rank, projections=lora.projections, tp_size=1, pp_size=1)
    return params * DTYPE_BYTES[cfg.model.params_dtype]


def _sync_summary(cfg: GTPOConfig, arch: Architecture, layout: Layout, args: argparse.Namespace) -> str:
    """The weight sync of ``rollout.weight_sync``: bytes in the engine dtype, time and the bandwidth assumed."""
    dtype = cfg.engine_dtype
    nbytes = DTYPE_BYTES[dtype]
    volume = f"{arch.total_params() * nbytes / 1e9:.1f} GB ({dtype}) per sync"
    if _adapter_bytes(cfg, arch):
        return (
            f"weight sync (rollout.lora_sync=adapter: the adapters gathered to rank 0, a PEFT folder in each engine "
            f"leader's /dev/shm; the base weights never move): {_adapter_bytes(cfg, arch) / 1e9:.2f} GB "
            f"({cfg.model.params_dtype}) per sync against {volume} merged, {_sync_seconds(cfg, arch, layout, args):.3f}"
            f" s at {args.sync_bandwidth_gbps:g} Gbit/s (--sync-bandwidth-gbps)"
        )
    if cfg.rollout.weight_sync == "files":
        seconds = _sync_seconds(cfg, arch, layout, args)
        return (
            f"weight sync (files: safetensors written to /dev/shm, then re-read by the engine): {volume}, "
            f"{seconds:.2f} s assuming {FILES_GBPS:g} Gbit/s for each pass"
        )
    seconds = _sync_seconds(cfg, arch, layout, args)
    workers = layout.num_engines * layout.engine_tp_size
    if cfg.rollout.weight_sync == "sharded":
        return (
            f"weight sync (sharded: every training rank sends its own pieces to the {workers} engine workers over "
            f"gloo; the busiest link sets the time): {volume}, {seconds:.2f} s at {args.sync_bandwidth_gbps:g} "
            "Gbit/s (--sync-bandwidth-gbps)"
        )
    relay = ", the one on rank 0's GPU through a relay" if cfg.rollout.placement == "colocated" else ""
    return (
        f"weight sync (collective: NCCL broadcast of buckets from rank 0 to the {workers} engine workers{relay}; "
        f"pipelined, so about one pass over the slowest link): {volume}, {seconds:.2f} s at "
        f"{args.sync_bandwidth_gbps:g} Gbit/s (--sync-bandwidth-gbps)"
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point: print the plan and exit with its status."""
    status, text = run(argv)
    print(text, file=sys.stdout if status == 0 else sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
