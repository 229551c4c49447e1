"""Run megatron-core (0.16.1 to 0.19.2) on a machine without CUDA (gloo, CPU tensors); inert when CUDA is available.

Megatron-core calls CUDA where no flag reaches: RoPE and ``torch.empty`` on ``torch.cuda.current_device()``, the
CUDA RNG tracker, DDP's ``current_stream()`` (0.19), ``device="cuda"`` literals in the schedules and the FP32
optimizer, and ``param.grad.type() == "torch.cuda.FloatTensor"`` checks. ``install_cpu_compat()`` swaps the
``torch.cuda`` and Megatron CUDA-RNG entry points for CPU ones (idempotent, logged once); ``cuda_to_cpu_mode()``, a
``TorchFunctionMode`` the policy enters around the schedule and ``optimizer.step()``, sends ``"cuda"`` devices to
the CPU and makes ``Tensor.type()`` report ``torch.cuda.*Tensor``. With CUDA neither changes anything.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_installed = False


def cpu_compat_needed() -> bool:
    """True when CUDA is unavailable, i.e. when the shim must be used."""
    return not torch.cuda.is_available()


class NullStream:
    """Stand-in for a CUDA stream (a class, as ``torch.cuda.Stream`` is): every synchronisation is immediate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Any device and priority: there is one null stream."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wait for."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def record_event(self, *args: Any, **kwargs: Any) -> NullStream:
        """The event: itself (its ``synchronize`` is immediate too)."""
        return self

    def query(self) -> bool:
        """Always done."""
        return True


def install_cpu_compat() -> bool:
    """Patch the CUDA entry points Megatron calls unconditionally; True if active, False with CUDA."""
    global _installed
    if not cpu_compat_needed():
        return False
    if _installed:
        return True
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_stream = lambda *a, **k: NullStream()
    torch.cuda.default_stream = lambda *a, **k: NullStream()
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _installed = True
    logger.warning("CUDA is not available: megatron-core runs on CPU through gtpo_megatron's cpu_compat shim")
    return True


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA allocations and moves to the CPU; report CPU tensors as CUDA tensors to type checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cuda_to_cpu_mode() -> contextlib.AbstractContextManager:
    """Context manager around Megatron calls with hard-coded ``"cuda"`` literals; a no-op when CUDA exists."""
    if not cpu_compat_needed():
        return contextlib.nullcontext()
    install_cpu_compat()
    return _CudaToCpuMode()
