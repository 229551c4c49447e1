"""Megatron DDP, Megatron Adam(W), the LR schedule and the non-finite-gradient guard, from ``PolicySettings``.

Precision: fp32 parameters, or bf16 ones with fp32 main weights, gradient reduction and Adam states; no loss
scaler. The distributed optimizer shards main weights and Adam states over the DP group (both run on CPU).

LR convention (Megatron-LM's): update k (1-based) trains at ``lr(k-1)`` of Megatron's ``OptimizerParamScheduler``;
the schedule advances after the update. Warm-up over ``W`` steps starts at ``lr / (W + 1)``: update k <= W + 1
trains at ``lr * k / (W + 1)``, the first after warm-up at the peak; then ``schedule.decay_style`` to ``min_lr``
at ``schedule.total_steps`` (the last update trains at ``lr(total_steps - 1)``). A resume applies the config's
schedule at the checkpoint's position (:func:`restore_schedule`).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.megatron_adapter.cpu_compat import cpu_compat_needed, cuda_to_cpu_mode

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

logger = logging.getLogger(__name__)


def ddp_config(settings: PolicySettings):
    """Megatron's DDP config: fp32 grad buffers, no overlap, grads pre-scaled by ``1/dp_size`` (``forward_step``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.parallel.use_distributed_optimizer,
        average_in_collective=False,
    )


def optimizer_config(settings: PolicySettings, *, params_dtype: torch.dtype):
    """Megatron's ``OptimizerConfig`` for Adam(W) with the ``optim`` section's lr, betas, weight decay and clipping."""
    from megatron.core.optimizer import OptimizerConfig

    optim = settings.optim
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=settings.parallel.use_distributed_optimizer,
    )


def scheduler_kwargs(settings: PolicySettings) -> dict:
    """Arguments of Megatron's ``OptimizerParamScheduler`` besides the optimizer (module docstring)."""
    optim, schedule = settings.optim, settings.schedule
    return dict(
        init_lr=optim.lr / (optim.warmup_steps + 1),
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=schedule.total_steps,
        lr_decay_style=schedule.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=schedule.total_steps,
        wd_incr_style="constant",
    )


def wrap_ddp(model, transformer_config, *, settings: PolicySettings):
    """Wrap an unwrapped ``GPTModel`` stage in Megatron's ``DistributedDataParallel`` (:func:`ddp_config`)."""
    from megatron.core.distributed import DistributedDataParallel

    with cuda_to_cpu_mode():
        return DistributedDataParallel(config=transformer_config, ddp_config=ddp_config(settings), module=model)


def build_optimizer(ddp_model, *, settings: PolicySettings, params_dtype: torch.dtype):
    """Megatron Adam(W) over the DDP model and its LR schedule; returns ``(optimizer, lr_scheduler)``."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if cpu_compat_needed() and not settings.parallel.use_distributed_optimizer:
        logger.warning("CPU fallback: Megatron's non-distributed Adam (full fp32 optimizer state on every DP rank)")
    with cuda_to_cpu_mode():
        optimizer = get_megatron_optimizer(optimizer_config(settings, params_dtype=params_dtype), [ddp_model])
    fuse_cpu_adam(optimizer)
    return optimizer, OptimizerParamScheduler(optimizer, **scheduler_kwargs(settings))


def fuse_cpu_adam(optimizer) -> None:
    """Give torch's Adam(W) under Megatron's optimizer its fused kernel where every parameter is contiguous on the CPU.

    Without Transformer Engine or apex, Megatron builds ``torch.optim.AdamW`` with neither ``fused`` nor ``foreach``,
    which on CPU tensors is the per-tensor loop: about ten element-wise passes over each parameter. The fused CPU
    kernel (``torch._fused_adamw_``) is one pass of the same update (docs/performance.md); TRL and transformers'
    Trainer use it too. Also applied after a checkpoint's ``param_groups`` are loaded (they carry the flag).
    The kernel walks each tensor's memory in order, ignoring its strides (torch 2.13): a non-contiguous parameter,
    whose Adam states copy its strides, would be updated at the wrong elements, so such an optimizer keeps the loop
    (its flag cleared, whatever a loaded checkpoint said).
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        strided = sum(not p.is_contiguous() for p in params)
        if strided:
            logger.warning("%d non-contiguous parameters: Adam keeps the per-tensor loop (fuse_cpu_adam)", strided)
        for group in [inner.defaults, *inner.param_groups]:
            group.update(fused=not strided, foreach=False)


def is_fused(optimizer) -> bool:
    """Whether :func:`fuse_cpu_adam` switched ``optimizer``'s Adam to the fused kernel."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(group.get("fused") for c in chained for group in getattr(c, "optimizer", c).param_groups)


def global_grad_norm(optimizer) -> float:
    """Megatron's L2 norm of the whole gradient (model-parallel and, distributed optimizer, DP all-reduce)."""
    with cuda_to_cpu_mode():
        optimizer.prepare_grads()
        return float(optimizer.get_grad_norm())


def optimizer_step(optimizer, scheduler, ddp_model) -> dict[str, float]:
    """Clip and apply the gradients, then advance the LR schedule; zero the gradients.

    A non-finite global norm (the same on every rank) skips the update and the schedule with a ``RuntimeWarning``.

    Returns:
        ``{"grad_norm", "lr", "skipped"}``: norm before clipping, lr of this update, 1.0 if skipped else 0.0.
    """
    grad_norm = global_grad_norm(optimizer)
    with cuda_to_cpu_mode():
        skipped = not math.isfinite(grad_norm)
        if skipped:
            warnings.warn(f"non-finite gradient norm {grad_norm}: optimizer step skipped", RuntimeWarning, stacklevel=2)
        lr = float(optimizer.param_groups[0]["lr"])
        if not skipped:
            optimizer.step()
            scheduler.step(increment=1)
        optimizer.zero_grad()
        ddp_model.zero_grad_buffer()
    return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}


_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def restore_schedule(scheduler, saved: dict) -> dict[str, tuple]:
    """Move the config's ``scheduler`` to the position of ``saved``, a checkpoint's scheduler state.

    Call after loading the optimizer state (it brings back the param groups' old ``max_lr``/``min_lr``). Megatron's
    ``load_state_dict`` would take lr, warm-up and decay length from ``saved``; only ``num_steps`` is. Returns
    ``{field: (checkpoint value, config value)}`` of the differing fields (also logged).
    """
    current = scheduler.state_dict()
    changed = {name: (saved[name], current[name]) for name in _SCHEDULE_FIELDS if saved.get(name) != current[name]}
    for group in scheduler.optimizer.param_groups:
        group.update(max_lr=scheduler.max_lr, min_lr=scheduler.min_lr)
    scheduler.num_steps = 0
    scheduler.step(increment=saved["num_steps"])
    if changed:
        listed = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in changed.items())
        logger.warning("resume at update %d applies the config's LR schedule: %s", saved["num_steps"], listed)
    return changed
