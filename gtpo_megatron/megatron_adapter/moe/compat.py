"""What megatron-core's ``MoELayer`` needs where Transformer Engine or CUDA is missing (idempotent, logged once).

* Without Transformer Engine, megatron-core 0.16 never defines ``moe_utils.te_general_gemm``, which the router's
  gating GEMM reads (0.19 sets it to None): it is set to None, so the router multiplies with ``torch.mm``.
* Without CUDA (``cpu_compat``), the ``alltoall`` dispatcher copies its split sizes to the host on a side stream as
  numpy arrays, which ``all_to_all_single`` and the output allocation read as integer sequences; the tensors are
  already on the host there, so the copy becomes ``.numpy()`` and the side stream ``cpu_compat``'s null stream.
  ``torch.cuda.Stream`` stays a class (``NullStream``): libraries imported later evaluate annotations such as
  ``torch.cuda.Stream | None``, which a function in its place breaks (transformers 5.25's model loading).
"""

from __future__ import annotations

import contextlib

import torch

from gtpo_megatron.megatron_adapter.cpu_compat import NullStream, cpu_compat_needed

_installed = False


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU: numpy when asked, else unchanged."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def install_moe_compat() -> None:
    """Apply the module's patches that this machine needs (nothing with both TE and CUDA)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if cpu_compat_needed():
        torch.cuda.Stream = NullStream  # a class still: annotations such as `torch.cuda.Stream | None` evaluate
        torch.cuda.stream = lambda stream: contextlib.nullcontext()
        token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _installed = True
