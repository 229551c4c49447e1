"""Build a run's engine side from its config: placements, CPU core binding, engines, weight sync, fault tolerance.

Every engine leader (``plan.engines``; global rank 0 always is one) owns a vLLM engine (multiprocess: the in-process
engine hangs in its distributed init inside a multi-rank job) on its devices or CPU cores and a reward pool. With
``rollout.weight_sync: collective`` the weight group joining rank 0 and every engine worker is built here, once
(the path: ``config/weight_sync.py``). ``build.build_trainer`` calls these in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron.config import GTPOConfig
from gtpo_megatron.config.weight_sync import run_weight_sync
from gtpo_megatron.plan.engines import (
    CoreSplit,
    EnginePlacement,
    engine_placements,
    engine_pool_gpus,
    relay_workers,
    resolve_num_engines,
    split_cores,
    visible_devices,
)

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.rollout.engine_guard import GuardedEngine
    from gtpo_megatron.rollout.exchange import StepExchange

logger = logging.getLogger(__name__)


def ranks_per_node(world_size: int) -> int:
    """Training ranks per node: torchrun's ``LOCAL_WORLD_SIZE`` (the whole world without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def build_placements(cfg: GTPOConfig, world_size: int) -> list[EnginePlacement]:
    """Every engine's leader, ranks and devices for this job (``plan.engines``; the same list on every rank).

    Raises:
        ValueError: the engines do not tile the world or the engine GPUs, or the files weight path with several.
    """
    rollout, accelerator = cfg.rollout, torch.cuda.is_available()
    num_engines = resolve_num_engines(
        rollout.num_engines,
        placement=rollout.placement,
        train_world_size=world_size,
        engine_tp_size=rollout.engine_tp_size,
        num_engine_gpus=rollout.num_engine_gpus,
        accelerator=accelerator,
    )
    if rollout.fault_tolerance and num_engines < 2:
        raise ValueError(
            f"rollout.fault_tolerance=true continues a step on the surviving engines, but rollout.num_engines="
            f"{rollout.num_engines} gives {num_engines} here; set rollout.num_engines >= 2 or fault_tolerance=false"
        )
    if run_weight_sync(cfg, accelerator=accelerator).path == "files" and num_engines != 1:
        raise ValueError(
            f"rollout.weight_sync=files feeds one engine, but rollout.num_engines=auto gives {num_engines} here; "
            "use rollout.weight_sync=collective or rollout.num_engines=1"
        )
    pool = engine_pool_gpus(
        placement=rollout.placement, engine_tp_size=rollout.engine_tp_size, num_engine_gpus=rollout.num_engine_gpus
    )
    return engine_placements(
        placement=rollout.placement,
        num_engines=num_engines,
        engine_tp_size=rollout.engine_tp_size,
        train_world_size=world_size,
        ranks_per_node=ranks_per_node(world_size),
        pool_gpus=pool,
        accelerator=accelerator,
    )


def cpu_core_split(cfg: GTPOConfig, placements: list[EnginePlacement], world_size: int, node: int) -> CoreSplit | None:
    """CPU ``node``'s ``split_cores`` (separate engines apart from its ranks); None with GPUs or one colocated engine.

    Several colocated engines split the cores among themselves; one keeps vLLM's binding (the ranks wait meanwhile).
    """
    if torch.cuda.is_available():
        return None
    per_node = ranks_per_node(world_size)
    engines = [p for p in placements if p.leader_rank // per_node == node]
    separate = cfg.rollout.placement == "separate"
    if not engines or (not separate and len(engines) == 1):
        return None
    return split_cores(sorted(os.sched_getaffinity(0)), num_trainer_ranks=per_node if separate else 0,
                       num_engines=len(engines), engine_tp_size=cfg.rollout.engine_tp_size)  # fmt: skip


def _node_slot(placement: EnginePlacement, placements: list[EnginePlacement], world_size: int) -> tuple[int, int]:
    """``(node, slot)``: the node of ``placement``'s leader and its index among the engines led there."""
    per_node = ranks_per_node(world_size)
    node = placement.leader_rank // per_node
    return node, [p.index for p in placements if p.leader_rank // per_node == node].index(placement.index)


def engine_environment(
    placement: EnginePlacement, placements: list[EnginePlacement], cfg: GTPOConfig, world_size: int
) -> dict[str, str]:
    """Environment of one engine's processes: its GPUs (``visible_devices``), or its CPU cores (``cpu_core_split``)."""
    if placement.devices:
        return {"CUDA_VISIBLE_DEVICES": visible_devices(placement.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))}
    node, slot = _node_slot(placement, placements, world_size)
    split = cpu_core_split(cfg, placements, world_size, node)
    return {} if split is None else {"VLLM_CPU_OMP_THREADS_BIND": split.engine_binding(slot)}


def bind_training_rank(cfg: GTPOConfig, placements: list[EnginePlacement], rank: int, world_size: int):
    """Separate engines on CPU: pin every thread of this rank to its cores, torch's thread count to match.

    Returns ``(its cores, its engine's cores or None)``, or None where nothing is bound (``cpu_core_split``).
    """
    per_node = ranks_per_node(world_size)
    split = cpu_core_split(cfg, placements, world_size, rank // per_node)
    if split is None or not split.trainers:
        return None
    mine = next((p for p in placements if p.leader_rank == rank), None)
    engine = None if mine is None else split.engine_cores(_node_slot(mine, placements, world_size)[1])
    cores = split.trainers[rank % per_node]
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)
    torch.set_num_threads(len(cores))
    shared = sorted(set(cores) & {c for worker in split.engine_workers for c in worker})
    logger.log(logging.WARNING if shared else logging.INFO, "training rank %d on cores %s (%d torch threads); "
               "cores shared with the node's engines (fewer cores than ranks and engine workers): %s", rank,
               list(cores), len(cores), shared or "none")  # fmt: skip
    return cores, engine


def build_collector(
    cfg: GTPOConfig,
    model_path: str,
    tokenizer,
    placement: EnginePlacement,
    environment: dict,
    exchange: StepExchange,
    cores=None,
):
    """An engine leader's ``RolloutCollector``: its guarded vLLM engine and reward pool (``cores``: the collector's)."""
    from gtpo_megatron.data.prompts import SYSTEM_PROMPTS
    from gtpo_megatron.rewards import RewardPool, default_extraction
    from gtpo_megatron.rollout.collector import RolloutCollector

    engine = build_engine(cfg, model_path, placement, environment)
    pool = RewardPool(cfg.reward.name, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    return RolloutCollector(
        engine=engine,
        reward_pool=pool,
        tokenizer=tokenizer,
        exchange=exchange,
        extraction=cfg.reward.extraction or default_extraction(cfg.data.source),
        system_prompt=SYSTEM_PROMPTS[cfg.data.system_prompt],
        engine_index=placement.index,
        cores=cores,
    )


def build_engine(cfg: GTPOConfig, model_path: str, placement: EnginePlacement, environment: dict) -> GuardedEngine:
    """The guarded vLLM engine of ``placement`` (health-checked with ``rollout.fault_tolerance``); also its restart."""
    from gtpo_megatron.rollout.engine_guard import GuardedEngine, HealthCheck
    from gtpo_megatron.rollout.engine_settings import engine_settings
    from gtpo_megatron.rollout.vllm_async_engine import AsyncVLLMEngine
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    settings = engine_settings(cfg, accelerator=torch.cuda.is_available())
    engine_class = AsyncVLLMEngine if cfg.rollout.partial_rollouts else VLLMEngine
    engine = engine_class(model_path, settings, environment=environment)
    logger.info("started %s with %s", placement.describe(), environment or "the default environment")
    health = HealthCheck.from_config(cfg.rollout) if cfg.rollout.fault_tolerance else None
    return GuardedEngine(engine, placement=placement, timeout_s=cfg.rollout.timeout_s, health=health)


def build_weight_sync(
    cfg: GTPOConfig,
    groups: ParallelGroups,
    engine: GuardedEngine | None,
    placements: list[EnginePlacement],
    policy: MegatronPolicy,
):
    """This rank's part of the weight push (``rollout.push``, ``rollout.sharded_sync``); joins the weight group.

    Collective and sharded: every rank takes part. ``engine`` is this rank's engine when it leads one of
    ``placements`` (the members: every engine, or with fault tolerance the live ones; collective worker offsets
    follow their order).

    Raises:
        ValueError: a ``rollout.weight_sync`` the run's settings rule out, e.g. ``sharded`` with GPUs
            (``config/weight_sync.py``).
    """
    from gtpo_megatron.rollout.push import CollectiveWeightSync, FilesWeightSync, connect_weight_group

    rollout, accelerator = cfg.rollout, torch.cuda.is_available()
    path = run_weight_sync(cfg, accelerator=accelerator).path
    bucket_bytes, exporting = rollout.weight_sync_bucket_mb * 2**20, groups.in_weight_gather
    if cfg.model.lora.enabled and rollout.lora_sync == "adapter":
        return _adapter_sync(cfg, groups, engine, placements, policy)
    if path == "files":
        return FilesWeightSync(engine=engine, exporting=exporting, bucket_bytes=bucket_bytes)
    mine = next((p for p in placements if p.leader_rank == groups.rank), None)
    position = None if mine is None else placements.index(mine)
    if path == "sharded":
        return _sharded_sync(cfg, groups, engine, mine, len(placements), policy)
    relay = None
    if placements[0].index == 0:  # colocated on GPU: engine 0's first worker shares rank 0's GPU
        relay = relay_workers(
            placements, placement=rollout.placement, engine_tp_size=rollout.engine_tp_size, accelerator=accelerator
        )
    group, signal = connect_weight_group(
        engine=engine,
        worker_offset=position * rollout.engine_tp_size if position is not None else 0,
        num_workers=len(placements) * rollout.engine_tp_size,
        backend="nccl" if accelerator else "gloo",
        timeout_s=rollout.timeout_s,
        world=dist.group.WORLD if groups.world_size > 1 else None,
        is_sender=groups.rank == 0,
        relay=relay,
    )
    return CollectiveWeightSync(engine=engine, group=group, exporting=exporting, bucket_bytes=bucket_bytes,
                                dtype=getattr(torch, cfg.engine_dtype), signal=signal)  # fmt: skip


def _adapter_sync(cfg, groups, engine, placements, policy):
    """``rollout.lora_sync: adapter`` (``rollout.adapter_sync``): PEFT folders, no weight group."""
    from gtpo_megatron.megatron_adapter.lora_gather import adapter_spec, gather_adapter_tensors
    from gtpo_megatron.rollout.adapter_sync import AdapterWeightSync

    others = any(p.leader_rank != 0 for p in placements)  # the leaders other than rank 0 get the adapters from it
    return AdapterWeightSync(
        engine=engine,
        gather=lambda: gather_adapter_tensors(policy.model, groups),
        exporting=groups.in_weight_gather,
        is_sender=groups.rank == 0,
        spec=adapter_spec(cfg.model.lora, cfg.model.name_or_path),
        world=dist.group.WORLD if others and groups.world_size > 1 else None,
    )


def _sharded_sync(cfg, groups, engine, mine, num_engines: int, policy):
    """``rollout.weight_sync: sharded``: plan and join (``rollout.sharded_sync.connect_sharded_sync``)."""
    from gtpo_megatron.rollout.engine_slices import EngineGeometry
    from gtpo_megatron.rollout.sharded_sync import connect_sharded_sync

    rollout, model = cfg.rollout, policy.geometry
    engines = None
    if rollout.engine_tp_size > 1:  # each worker receives only its slice (rollout/engine_slices.py)
        engines = EngineGeometry(tp_size=rollout.engine_tp_size, num_heads=model.num_heads,
                                 num_kv_heads=model.num_query_groups, head_dim=model.head_dim,
                                 vocab_size=model.vocab_size)  # fmt: skip
    return connect_sharded_sync(
        engine=engine,
        pieces=policy.shard_pieces,
        rank=groups.rank,
        worker_offset=mine.index * rollout.engine_tp_size if mine is not None else 0,
        num_workers=num_engines * rollout.engine_tp_size,
        bucket_bytes=rollout.weight_sync_bucket_mb * 2**20,
        dtype=getattr(torch, cfg.engine_dtype),
        timeout_s=rollout.timeout_s,
        world=dist.group.WORLD if groups.world_size > 1 else None,
        engines=engines,
    )


def build_fault_tolerance(cfg, groups, collector, placements, weight_sync, restart, policy):
    """``rollout.fault_tolerance``'s recovery on this rank (``restart``: a new engine for a leader, else None)."""
    from gtpo_megatron.rollout.fault_tolerance import FaultTolerance

    return FaultTolerance(
        placements=placements,
        rank=groups.rank,
        collector=collector,
        rollout=cfg.rollout,
        group=dist.group.WORLD,
        restart=restart,
        rebuild=lambda engine, members: build_weight_sync(cfg, groups, engine, members, policy),
        weight_sync=weight_sync,
    )
