"""Save/load a ``MegatronPolicy`` (model, optimizer, LR schedule, RNG) and trainer state as Megatron dist checkpoints.

Layout (names owned by ``run_dir``): ``<root>/step_000010/`` (sharded tensors + common state) and ``<root>/latest``.
Every rank writes into ``run_dir.temporary_dir``; after a barrier rank 0 writes the completeness marker, renames
the folder and replaces ``latest``, so a killed save leaves at most a stale ``.tmp`` folder.

Model and optimizer tensors are ``ShardedTensor`` s in the global layout (the distributed optimizer
``fully_reshardable``): a checkpoint loads into any TP/PP/DP layout. RNG states are restored only into the same
layout. A load takes the LR schedule's position only (``optimizer.restore_schedule``: the config's schedule applies).
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

from gtpo_megatron.megatron_adapter.head_padding import resume_padding_error
from gtpo_megatron.megatron_adapter.lora import adapter_signature, check_adapter_signature, checkpointed_model_state
from gtpo_megatron.megatron_adapter.optimizer import fuse_cpu_adam, restore_schedule
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
    return {"tp_size": groups.tp_size, "pp_size": groups.pp_size, "dp_size": groups.dp_size, "ep_size": groups.ep_size}


def _num_experts(policy) -> int:
    """Experts of each MoE layer of ``policy`` (0: dense); saved with the checkpoint and checked on load."""
    moe = policy.geometry.moe
    return moe.num_experts if moe is not None else 0


def _check_experts(common: dict, policy, folder: Path) -> None:
    """Refuse a checkpoint of another expert count before any tensor is read (it would load half the experts)."""
    saved = common.get("num_experts", 0)  # checkpoints of dense-only versions lack the key
    if saved != _num_experts(policy):
        raise ValueError(
            f"checkpoint {str(folder)!r} holds a model with {saved} experts a layer (0: dense), the policy has "
            f"{_num_experts(policy)}; resume with the model (model.name_or_path) the checkpoint was written with"
        )


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
    """Refuse loading into the distributed optimizer without Apex/TE (``RuntimeError`` with the remedy).

    megatron-core 0.16-0.19 then wraps ``torch.optim.Adam``, whose lazy per-parameter ``step`` state breaks loading
    the reshardable formats (``assert len(steps) == 1``; ``KeyError: 'step'``); saving works.
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
    model_sd = checkpointed_model_state(policy.model.sharded_state_dict(), policy.model)
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
    """Serve Megatron's write-results queue from a forked process that ignores the stop signals (once).

    megatron-core's ``torch_dist`` writer reports through a queue served by a ``multiprocessing`` manager
    (``filesystem_async._results_queue``). SIGTERM/SIGINT/SIGUSR1 reach every process of the job and would kill
    that server, and with it the save meant to keep the run: ``preemption.start_helper_manager`` ignores them and
    ends with this process. Without that attribute (another megatron-core) nothing is done.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from gtpo_megatron.preemption import start_helper_manager

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = start_helper_manager()
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def save_checkpoint(path: str | Path, policy, trainer_state: dict, *, rng: dict | None = None) -> Path:
    """Save ``policy`` and ``trainer_state`` to the folder ``path`` (its parent's ``latest`` is updated); all ranks.

    ``trainer_state``: plain values and tensors (read back ``weights_only``; rank 0's copy is kept). ``rng``: the
    RNG states to store (:func:`rng_state` taken at the last step boundary); None: the current ones. Returns the
    final folder. Collectives: barriers and dist_checkpointing's own, on the world group.
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
            scheduler=policy.scheduler.state_dict(),
            trainer_state=trainer_state,
            layout=_layout(policy.groups),
            num_experts=_num_experts(policy),
            lora=adapter_signature(policy.model),
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


def _use_config_lr(optimizer_state: dict, param_groups: list[dict]) -> None:
    """Give the loaded param groups the config's ``max_lr``/``min_lr``, matched by position (in place).

    megatron-core 0.17+ pairs loaded and current param groups by a key that includes ``max_lr``/``min_lr``, so a
    resume with a changed ``optim.lr`` would not load; the schedule is the config's anyway (``restore_schedule``).
    """
    current = iter(param_groups)

    def walk(node) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for group in node.get("param_groups") or ():
                config_group = next(current, None)
                if config_group is not None and "max_lr" in group:
                    group.update(max_lr=config_group["max_lr"], min_lr=config_group["min_lr"])
            for key, value in node.items():
                if key not in ("param_groups", "state"):
                    walk(value)

    walk(optimizer_state)


def _open(path: str | Path, policy) -> tuple[Path, dict]:
    """The checkpoint folder of ``path`` and its common state, refused before any tensor is read if it cannot load."""
    from megatron.core import dist_checkpointing

    folder = resolve_checkpoint_dir(path)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    _check_experts(common, policy, folder)
    check_adapter_signature(common.get("lora"), policy.model, str(folder))
    _check_shapes(folder, common["layout"]["tp_size"], policy)
    return folder, common


def _check_shapes(folder: Path, saved_tp_size: int, policy) -> None:
    """Refuse a checkpoint whose model tensors' global shapes (its metadata file) are not ``policy``'s.

    The padded heads (``head_padding.resume_padding_error``) or vocabulary of another TP size.
    """
    from megatron.core.dist_checkpointing import ShardedTensor, load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved = load_tensors_metadata(str(folder))
    for tensor in nested_values(policy.model.sharded_state_dict()):
        if not isinstance(tensor, ShardedTensor) or tensor.key not in saved:
            continue
        was, now = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
        if was == now:
            continue
        geometry, tp_size = policy.geometry, policy.groups.tp_size
        error = resume_padding_error(
            str(folder),
            saved_tp_size=saved_tp_size,
            tp_size=tp_size,
            num_heads=geometry.num_heads,
            num_query_groups=geometry.num_query_groups,
            padded_groups=geometry.padded_num_query_groups,
        )
        raise error or ValueError(
            f"checkpoint {str(folder)!r}: {tensor.key} is {was} there, {now} in this model (written at "
            f"parallel.tp_size={saved_tp_size}, now {tp_size}: the padded vocabulary differs); resume with the "
            "checkpoint's parallel.tp_size and model section"
        )


def _load_model_state(policy, state: dict) -> None:
    """Copy a loaded model state into ``policy``: every tensor, or with LoRA the adapters (the base stays)."""
    if adapter_signature(policy.model) is None:
        policy.model.load_state_dict(state)
        return
    result = policy.model.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if "_lora." in key]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"LoRA checkpoint state: adapters missing {missing}, unexpected {result.unexpected_keys}")


def load_model_weights(path: str | Path, policy) -> None:
    """The model's tensors of a checkpoint (folder or root), in any layout, into ``policy``. All ranks.

    No optimizer, LR schedule, RNG or trainer state: what an export needs, without a resume's messages.

    Raises:
        ValueError: as :func:`load_checkpoint`.
    """
    from megatron.core import dist_checkpointing

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    folder, _ = _open(path, policy)
    with cuda_to_cpu_mode():
        model_sd = checkpointed_model_state(policy.model.sharded_state_dict(), policy.model)
        loaded = dist_checkpointing.load({"model": model_sd}, str(folder))
        _load_model_state(policy, loaded["model"])


def load_checkpoint(path: str | Path, policy) -> dict:
    """Load a checkpoint (folder or root) into ``policy`` in any layout; returns the saved trainer state. All ranks.

    Raises:
        ValueError: see ``run_dir.resolve_checkpoint_dir``; a checkpoint of another expert count.
        RuntimeError: distributed optimizer without Apex/TE (``_check_loadable``).
    """
    from megatron.core import dist_checkpointing

    from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode

    folder, common = _open(path, policy)
    same_layout = {"ep_size": 1, **common["layout"]} == _layout(policy.groups)
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
        _load_model_state(policy, loaded["model"])
        _use_config_lr(loaded["optimizer"], policy.optimizer.param_groups)
        policy.optimizer.load_state_dict(loaded["optimizer"])
        fuse_cpu_adam(policy.optimizer)
    restore_schedule(policy.scheduler, common["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    return common["trainer_state"]
