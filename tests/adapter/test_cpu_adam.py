"""``fuse_cpu_adam``: the fused CPU AdamW updates like a float64 reference, and only where that holds.

torch's fused CPU kernel walks each tensor's memory in order, ignoring strides: on a column slice (the TP-split LoRA
``A`` of a row-parallel linear before ``lora._param`` made it contiguous) it updated the wrong elements (0.35 off
after two steps here), which is why such an optimizer keeps the per-tensor loop.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gtpo_megatron.megatron_adapter.optimizer import fuse_cpu_adam, is_fused

HYPER = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
UPDATE_ATOL = 1e-6  # fp32 against float64 over two steps of lr 0.1


def _adam(param: torch.Tensor) -> SimpleNamespace:
    """torch's AdamW over ``param`` in Megatron's wrapper shape (``.optimizer``)."""
    return SimpleNamespace(optimizer=torch.optim.AdamW([param], **HYPER))


def _apply(optimizer, param: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``param`` after one step per gradient; and whether the steps ran fused."""
    for grad in grads:
        param.grad = grad.to(param.dtype)
        optimizer.optimizer.step()
    return param.detach(), is_fused(optimizer)


def _steps(param: torch.Tensor, grads: list[torch.Tensor], *, fuse: bool) -> tuple[torch.Tensor, bool]:
    optimizer = _adam(param)
    if fuse:
        fuse_cpu_adam(optimizer)
    return _apply(optimizer, param, grads)


def _case(strided: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(4, 12, generator=gen)
    start = full[:, 6:] if strided else full[:, 6:].contiguous()  # rank 1's half of a [4, 12] A at TP 2
    return torch.nn.Parameter(start), [torch.randn(4, 6, generator=gen) for _ in range(2)]


def _reference(strided: bool) -> torch.Tensor:
    param, grads = _case(strided)
    updated, fused = _steps(torch.nn.Parameter(param.detach().double()), grads, fuse=False)
    assert not fused
    return updated


def test_contiguous_parameters_get_the_fused_kernel_and_the_reference_update():
    param, grads = _case(strided=False)
    updated, fused = _steps(param, grads, fuse=True)
    assert fused
    torch.testing.assert_close(updated.double(), _reference(strided=False), atol=UPDATE_ATOL, rtol=0)


def test_a_non_contiguous_parameter_keeps_the_loop_and_the_reference_update():
    param, grads = _case(strided=True)
    assert not param.is_contiguous()
    updated, fused = _steps(param, grads, fuse=True)
    assert not fused
    torch.testing.assert_close(updated.double(), _reference(strided=True), atol=UPDATE_ATOL, rtol=0)


def test_a_loaded_fused_flag_does_not_fuse_a_non_contiguous_parameter():
    """As ``checkpoint.load_checkpoint``: loaded ``param_groups`` say fused, ``fuse_cpu_adam`` after them decides."""
    param, grads = _case(strided=True)
    written = _adam(torch.nn.Parameter(param.detach().clone()))
    fuse_cpu_adam(written)
    optimizer = _adam(param)
    optimizer.optimizer.load_state_dict(written.optimizer.state_dict())
    assert is_fused(optimizer)  # the checkpoint's flag
    fuse_cpu_adam(optimizer)
    updated, fused = _apply(optimizer, param, grads)
    assert not fused
    torch.testing.assert_close(updated.double(), _reference(strided=True), atol=UPDATE_ATOL, rtol=0)
