"""Save/load a ``MegatronPolicy`` (model, optimizer, LR schedule, RNG) and trainer state: Megatron dist checkpoints.

``megatron.core.dist_checkpointing`` writes and reads the sharded state. Layout of a run's checkpoint folder (names
owned by ``run_dir``)::

    <root>/step_000010/         one dist checkpoint (Megatron's format: sharded tensors + common.pt)
    <root>/latest               text file holding the name of the newest complete checkpoint folder

Atomicity: every rank writes into ``run_dir.temporary_dir(<root>/<name>)``; after a barrier global rank 0 writes
the completeness marker (``run_dir.mark_complete``: the files and their sizes, written last), renames the folder to
``<root>/<name>`` and then replaces ``latest`` (``run_dir.write_latest``: write-to-temp + ``os.replace``). A killed
save therefore leaves at most a stale ``.tmp`` folder (removed by the next save of the same name) and never a
dangling ``latest``; a folder that lost files afterwards is refused (``run_dir.checkpoint_problem``).

Resharding: model and optimizer tensors are saved as Megatron ``ShardedTensor`` s in the model's global layout
(the distributed optimizer in its ``fully_reshardable`` format), so a checkpoint written with one TP/PP/DP layout
loads into another. The per-rank RNG states are only restored when the layout is identical (otherwise they are
meaningless and a warning says so). The LR schedule and ``trainer_state`` are common (rank-0) objects; a load takes
the schedule's position only (``optimizer.restore_schedule``: the config's schedule applies).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from gtpo_megatron.megatron_adapter.optimizer import restore_schedule
from gtpo_megatron.parallel.collectives import barrier
from gtpo_megatron.run_dir import (
    mark_complete,
    remove_checkpoint,
    resolve_checkpoint_dir,
    temporary_dir,
    write_latest,
)

if TYPE_CHECKING:
    from gtpo_megatron.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _layout(groups: ParallelGroups) -> dict[str, int]:
    return {"tp_size": groups.tp_size, "pp_size": groups.pp_size, "dp_size": groups.dp_size}


def rng_state() -> dict:
    """This process's RNG states (python, numpy, torch, CUDA, Megatron's model-parallel tracker), as saved."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _check_loadable(optimizer) -> None:
    """Refuse a load that megatron-core (0.16.1 and 0.19.2 alike) cannot perform, with the remedy.

    Without Apex or Transformer Engine (always the case on CPU) the distributed optimizer wraps ``torch.optim.Adam``,
    whose lazily created per-parameter ``step`` state breaks loading the reshardable formats (``state_dict``'s
    ``assert len(steps) == 1`` on a fresh optimizer; ``KeyError: 'step'`` in ``_set_main_param_and_optimizer_states``).
    Saving works; loading does not.

    Raises:
        RuntimeError: distributed optimizer without Apex/TE.
    """
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    if not HAVE_APEX_OR_TE and any(isinstance(inner, DistributedOptimizer) for inner in inners):
        raise RuntimeError(
            "loading a checkpoint into Megatron's distributed optimizer needs Apex or Transformer Engine "
            "(megatron-core fails on torch Adam's 'step' state); build the policy with "
            "use_distributed_optimizer=False (the CPU default), which loads any checkpoint of this project"
        )


def _sharded_state_dict(policy, *, is_loading: bool, rng: dict | None) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject

    groups = policy.groups
    model_sd = policy.model.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA),
    }
    if rng is not None:
        state["rng"] = ShardedObject(
            "rng_state",
            rng,
            (groups.pp_size, groups.tp_size, groups.dp_size),
            (groups.pp_rank, groups.tp_rank, groups.dp_rank),
            replica_id=0,
        )
    return state


def _sigterm_proof_write_queue() -> None:
    """Serve Megatron's write-results queue from a process that ignores the stop signals (once per process).

    megatron-core's ``torch_dist`` writer (0.16 and 0.19 alike) reports through a queue served by a spawned
    ``multiprocessing`` manager process, created at the first save and kept in
    ``filesystem_async._results_queue``. On preemption SIGTERM reaches every process of the job (Slurm signals the
    whole step; torchrun signals each worker's process group), which kills that server and every later save with
    it, the one meant to save the run included (SIGUSR1, forwarded the same way, too). Started here first, the
    server ignores both (SIGKILL still ends it, and it exits with the trainer). It is forked, not spawned: it starts
    in milliseconds (a SIGTERM during a spawned interpreter's start-up would kill it before it ignores the signal)
    and does not re-import the trainer. The writer processes Megatron forks for each save inherit the trainer's own
    handlers and survive as well. Without that module attribute (another megatron-core) nothing is done.
    """
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from gtpo_megatron.preemption import ignore_stop_signals

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(ignore_stop_signals)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def save_checkpoint(path: str | Path, policy, trainer_state: dict, *, rng: dict | None = None) -> Path:
    """Save ``policy`` and ``trainer_state`` to the checkpoint folder ``path``; all ranks call.

    ``trainer_state`` must hold plain Python values and tensors only: it is read back with ``torch.load``'s
    default ``weights_only=True`` (as global rank 0's copy; every rank should pass the same value). ``rng``: the
    RNG states to store (a :func:`rng_state` taken earlier, e.g. at the last step boundary); None: the current ones.

    ``path``'s parent is the checkpoint root whose ``latest`` file is updated. Returns the final folder.

    Collectives: barriers on the world group, plus dist_checkpointing's own (world group).
    """
    from megatron.core import dist_checkpointing

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    _sigterm_proof_write_queue()
    final = Path(path)
    tmp = temporary_dir(final)
    world = dist.group.WORLD
    if policy.groups.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(group=world)
    with cuda_to_cpu_mode():
        state = _sharded_state_dict(policy, is_loading=False, rng=rng or rng_state())
        state.update(
            scheduler=policy.scheduler.state_dict(), trainer_state=trainer_state, layout=_layout(policy.groups)
        )
        dist_checkpointing.save(state, str(tmp))
    barrier(group=world)
    if policy.groups.rank == 0:
        mark_complete(tmp)
        if final.exists():
            remove_checkpoint(final)
        os.replace(tmp, final)
        write_latest(final)
    barrier(group=world)
    return final


def load_checkpoint(path: str | Path, policy) -> dict:
    """Load a checkpoint (folder or root with ``latest``) into ``policy``; returns the saved trainer state.

    Works across TP/PP/DP layouts (module docstring). All ranks call.

    Raises:
        ValueError: see ``run_dir.resolve_checkpoint_dir``.
        RuntimeError: see ``_check_loadable`` (distributed optimizer without Apex/TE).
    """
    from megatron.core import dist_checkpointing

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    folder = resolve_checkpoint_dir(path)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    same_layout = common["layout"] == _layout(policy.groups)
    if not same_layout:
        logger.warning(
            "checkpoint layout %s differs from %s: RNG states are not restored",
            common["layout"],
            _layout(policy.groups),
        )
    _check_loadable(policy.optimizer)
    with cuda_to_cpu_mode():
        template = _sharded_state_dict(policy, is_loading=True, rng=rng_state() if same_layout else None)
        loaded = dist_checkpointing.load(template, str(folder))
        policy.model.load_state_dict(loaded["model"])
        policy.optimizer.load_state_dict(loaded["optimizer"])
    restore_schedule(policy.scheduler, common["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    return common["trainer_state"]
