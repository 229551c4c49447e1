"""Megatron DDP wrapper, Megatron Adam optimizer, LR schedule and the non-finite-gradient guard.

GPU: Megatron's distributed optimizer (sharded fp32 main weights and Adam states over the DP group) by default.
CPU: the same Megatron code runs through ``cpu_compat``; the default there is the *non*-distributed Megatron
optimizer (full fp32 main weights on every DP rank), logged as the CPU fallback. ``use_distributed_optimizer=True``
may be forced on CPU too (it works with the shim, FEASIBILITY section 2).

Precision: fp32 parameters, or bf16 parameters with fp32 main weights, fp32 gradient reduction and fp32 Adam
states (``Float16OptimizerWithFloat16Params`` / distributed optimizer). No loss scaler (bf16 does not need one).
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch

from gtpo_megatron.megatron_adapter.cpu_compat import cpu_compat_needed, cuda_to_cpu_mode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimSettings:
    """Adam + schedule settings (plain values; the trainer maps its ``optim`` config section onto them).

    ``lr`` is the peak learning rate; linear warm-up over ``warmup_steps`` from 0, then ``decay_style``
    (``"constant"``, ``"linear"`` or ``"cosine"``) down to ``min_lr`` at ``total_steps``. ``clip_grad`` is the
    global L2 gradient-norm clip (0 disables clipping; the norm is still reported).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1_000_000
    decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.lr={self.lr} must be > 0 and optim.min_lr={self.min_lr} in [0, lr]")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps} must be in [0, optim.total_steps={self.total_steps})"
            )
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.decay_style={self.decay_style!r}; choose constant, linear or cosine")

    def distributed(self) -> bool:
        """Whether to use Megatron's distributed optimizer (default: on GPU yes, on CPU no)."""
        if self.use_distributed_optimizer is None:
            return not cpu_compat_needed()
        return self.use_distributed_optimizer


def wrap_ddp(model, transformer_config, *, settings: OptimSettings):
    """Wrap an unwrapped ``GPTModel`` stage in Megatron's ``DistributedDataParallel`` (fp32 grad buffers).

    ``average_in_collective=False``: the gradient is pre-scaled by ``1/dp_size`` and summed, which
    ``forward_step``'s normalisation arithmetic relies on (any averaging variant gives the same factor).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.distributed(),
        average_in_collective=False,
    )
    with cuda_to_cpu_mode():
        return DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model, *, settings: OptimSettings, params_dtype: torch.dtype):
    """Megatron Adam(W) over the DDP model; returns ``(optimizer, lr_scheduler)``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=settings.distributed(),
    )
    if cpu_compat_needed() and not settings.distributed():
        logger.warning("CPU fallback: Megatron's non-distributed Adam (full fp32 optimizer state on every DP rank)")
    with cuda_to_cpu_mode():
        optimizer = get_megatron_optimizer(config, [ddp_model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=settings.total_steps,
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=settings.total_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def global_grad_norm(optimizer) -> float:
    """L2 norm of the whole model's gradient; prepares the main grads.

    Megatron's norm: TP duplicates counted once, all-reduced over the model-parallel group and, for the
    distributed optimizer, the DP group.
    """
    with cuda_to_cpu_mode():
        optimizer.prepare_grads()
        return float(optimizer.get_grad_norm())


def optimizer_step(optimizer, scheduler, ddp_model) -> dict[str, float]:
    """Clip and apply the gradients unless their global norm is non-finite; advance the LR schedule.

    The norm is Megatron's (all-reduced over model-parallel and, for the distributed optimizer, DP groups), so
    every rank takes the same decision. On a non-finite norm the update is skipped, gradients are zeroed, the
    schedule does not advance and a ``RuntimeWarning`` is issued. The schedule advances *before* the update, so
    the k-th applied step uses ``lr(k)`` (with warm-up, the first step is not a zero-lr step).

    Returns:
        ``{"grad_norm", "lr", "skipped"}``: norm before clipping, lr of this step, 1.0 if skipped else 0.0.
    """
    grad_norm = global_grad_norm(optimizer)
    with cuda_to_cpu_mode():
        skipped = not math.isfinite(grad_norm)
        if skipped:
            warnings.warn(f"non-finite gradient norm {grad_norm}: optimizer step skipped", RuntimeWarning, stacklevel=2)
        else:
            scheduler.step(increment=1)  # step k (1-based) uses the schedule's lr(k): no zero-lr first step
            optimizer.step()
        optimizer.zero_grad()
        ddp_model.zero_grad_buffer()
    lr = float(optimizer.param_groups[0]["lr"])
    return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}
