"""Distributed start-up and the frozen ``ParallelGroups`` handle (the only user of Megatron's ``parallel_state``).

Everything above this module receives its process groups explicitly; this module creates them once through
``parallel_state.initialize_model_parallel`` and freezes them in a ``ParallelGroups``. Rank order is Megatron's
default ``tp-cp-ep-dp-pp`` (TP ranks adjacent, PP slowest); context parallelism is 1. Experts are laid out on
the same ranks in Megatron's ``etp-ep-edp-pp`` order with expert TP 1, so the ``ep_size`` ranks of an EP group are
adjacent inside a pipeline stage (at TP=2, EP=2 they are a TP group's two ranks).
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtpo_megatron.plan.layout import world_problems

CUDA_BACKEND = "cpu:gloo,cuda:nccl"
"""The default process group's backend on a GPU machine: ``parallel.collectives`` runs tensor collectives on the
CUDA device (NCCL) and torch runs object collectives and barriers on the CPU (gloo)."""


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups, sizes and ranks of one process; ``mp`` is TP x PP of one data-parallel replica.

    ``ep`` is the expert-parallel group (size 1 for dense models: every rank holds every expert).

    ``pp_first_global_rank`` / ``pp_last_global_rank`` are the global ranks of this pipeline's first and last stage;
    ``backend`` is the default group's (:data:`CUDA_BACKEND`, ``"nccl"`` or ``"gloo"``).
    """

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    ep: dist.ProcessGroup
    tp_size: int
    pp_size: int
    dp_size: int
    ep_size: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    rank: int
    pp_first_global_rank: int
    pp_last_global_rank: int
    backend: str

    @property
    def is_first_pp_stage(self) -> bool:
        """True on pipeline stage 0 (the stage that owns the input embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        """True on the last pipeline stage (the stage that owns the output layer and computes the loss)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def in_weight_gather(self) -> bool:
        """True on the ranks that drain the HF weight stream (``hf_stream``).

        Data-parallel rank 0, whose replica holds every dense parameter, and with ``ep_size > 1`` every rank (an EP
        group's experts span data-parallel replicas).
        """
        return self.dp_rank == 0 or self.ep_size > 1

    def pp_stage_global_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline (same TP and DP coordinates)."""
        return dist.get_global_rank(self.pp, stage)


def init_distributed(
    *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, backend: str | None = None, timeout_s: float = 1800.0
) -> ParallelGroups:
    """Initialise ``torch.distributed`` from torchrun's environment (if needed) and Megatron's groups.

    ``backend=None``: :data:`CUDA_BACKEND` with CUDA (device from ``LOCAL_RANK``), else gloo. ``timeout_s``: every
    group's collective timeout (a run passes ``GTPOConfig.world_timeout_s``; Megatron's groups round it up to
    minutes).

    Raises:
        ValueError: a size below 1, or ``tp_size * pp_size`` or ``ep_size * pp_size`` does not divide the world
            size (``plan.layout.world_problems``).
    """
    if backend is None:
        backend = CUDA_BACKEND if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world_size = dist.get_world_size()
    problems = world_problems(
        world_size,
        tp_size=tp_size,
        pp_size=pp_size,
        ep_size=ep_size,
        described=f"the world size {world_size}",
        launch=f"a multiple of {tp_size * pp_size} ranks",
    )
    if problems:
        raise ValueError("; ".join(problems))
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=math.ceil(timeout_s / 60),
    )
    return current_groups(backend=dist.get_backend())


def current_groups(*, backend: str) -> ParallelGroups:
    """Freeze the groups of an already initialised ``parallel_state`` into a ``ParallelGroups``."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp)
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=pp,
        dp=ps.get_data_parallel_group(),
        mp=ps.get_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        rank=dist.get_rank(),
        pp_first_global_rank=pp_ranks[0],
        pp_last_global_rank=pp_ranks[-1],
        backend=backend,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's model-parallel state and the default process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
