"""What the GPU checks share: the device (CUDA, or the CPU in a dry run), the model, a one-rank process group.

``run_gpu_checks.sh --dry-run`` sets ``GTPO_GPU_DRY_RUN=1``: the checks then run their CPU-capable parts on the CPU
(gloo instead of NCCL, fp32, smaller sizes) and skip the CUDA-only ones with a reason, so the whole pipeline (wheel
install, imports, model cache, collection, the summary table) is exercised on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch

from tests.gpu.report import record

DRY_RUN = os.environ.get("GTPO_GPU_DRY_RUN") == "1"
DEVICE = torch.device("cpu") if DRY_RUN else torch.device("cuda")
MODEL = os.environ.get("GTPO_GPU_MODEL", "builtin:tiny-llama")
"""The model of the Megatron and trainer checks (``run_gpu_checks.sh --prepare`` ships ``builtin:tiny-llama``)."""


def loss_spec():
    """The GPU checks' objective: GTPO, seq-mean-token-mean, clip 0.2/0.2."""
    from gtpo_megatron.ops import LossSpec

    return LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


def needs_cuda(what: str) -> None:
    """Skip the calling check in a dry run (``what`` needs a real GPU)."""
    if DRY_RUN:
        pytest.skip(f"dry run: {what} needs CUDA")


def needs_module(name: str, label: str) -> None:
    """Skip the calling check when module ``name`` does not import, saying ``"skipped: no <label>"``."""
    try:
        __import__(name)
    except Exception as err:  # a broken install (TE without its CUDA libraries) counts as absent
        pytest.skip(f"skipped: no {label} ({name}: {type(err).__name__})")


@contextlib.contextmanager
def single_rank_world(backend: str | None = None):
    """A one-rank process group and Megatron TP = PP = 1 (``init_distributed``; ``backend=None``: its default,
    ``cpu:gloo,cuda:nccl`` with CUDA, gloo in a dry run); yields the ``ParallelGroups`` and tears both down."""
    from gtpo_megatron.parallel.groups import destroy_distributed, init_distributed

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    groups = init_distributed(tp_size=1, pp_size=1, backend="gloo" if DRY_RUN else backend)
    try:
        yield groups
    finally:
        destroy_distributed()


def build_policy(groups, path: str, params_dtype: str, *, lr: float = 1e-6, **model_fields):
    """A ``MegatronPolicy`` of ``path`` in ``params_dtype`` on ``groups``: micro-batches of 2 rows, Adam at ``lr``
    with gradient clipping 1.0."""
    from gtpo_megatron.config import ModelConfig, OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

    model = ModelConfig(name_or_path=path, params_dtype=params_dtype, **model_fields)
    settings = PolicySettings(model=model, optim=OptimConfig(lr=lr, clip_grad=1.0, micro_batch_size=2))
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def check_train_step(policy, batch, check: str, parameter: torch.nn.Parameter) -> dict[str, float]:
    """One ``train_step`` of ``batch`` (old log-probs: the policy's own plus noise): its loss against the float64
    reference, a finite non-zero gradient norm and a moved ``parameter``, recorded under ``check``; the metrics."""
    logprobs, _ = policy.compute_logprobs(batch)
    batch.old_logprobs = torch.where(batch.response_mask, logprobs + 0.1 * torch.randn_like(logprobs), 0.0)
    before = parameter.detach().clone()
    metrics = policy.train_step(batch, loss_spec())
    expected = reference_train_loss(logprobs, batch)
    batch.old_logprobs = None
    limit = 1e-2 * (1 + abs(expected))  # the training pass recomputes the same bf16 log-probs; a wrong normaliser
    record(check, "|loss - float64 reference|", abs(metrics["loss"] - expected), limit=limit)  # or sign: far off
    record(check, "grad norm", metrics["grad_norm"])
    assert abs(metrics["loss"] - expected) <= limit
    assert torch.isfinite(torch.tensor(metrics["grad_norm"])) and metrics["grad_norm"] > 0
    assert not torch.equal(before, parameter.detach())
    return metrics


def reference_train_loss(logprobs: torch.Tensor, batch) -> float:
    """Float64 reference (``tests.helpers.references.ref_policy_loss``) of one ``train_step`` of ``batch``.

    The step objective of the GPU checks' ``LOSS`` (seq-mean-token-mean, clip 0.2/0.2) over ``logprobs`` ``[B, S]``
    and ``batch.old_logprobs``, ``advantages`` and ``token_weights``, with the response tokens moved to the left.
    """
    from tests.helpers.references import ref_policy_loss

    lengths = batch.response_mask.sum(-1).tolist()
    starts = batch.response_mask.int().argmax(-1).tolist()

    def packed(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(t.shape[0], max(lengths), dtype=torch.float64)
        for i, (a, n) in enumerate(zip(starts, lengths, strict=True)):
            out[i, :n] = t[i, a : a + n].double()
        return out

    return ref_policy_loss(
        packed(logprobs), packed(batch.old_logprobs), batch.advantages.double(), packed(batch.token_weights),
        lengths, aggregation="seq-mean-token-mean", normalizer=float(sum(n > 0 for n in lengths)), clip_low=0.2,
        clip_high=0.2,
    ).item()  # fmt: skip
