"""The training-policy contract the trainer drives, next to ``rollout.engine.RolloutEngine`` (the sampling side).

``Policy`` is a ``typing.Protocol``: ``megatron_adapter.policy.MegatronPolicy`` is the real one, the trainer tests
use small fakes. Batches are ``batch.TrainBatch`` (this data-parallel rank's rows, on CPU); the step
objective comes as an ``ops.LossSpec``. Importing this module imports neither torch, megatron nor vllm.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from gtpo_megatron.batch import TrainBatch
    from gtpo_megatron.ops.losses import LossSpec
    from gtpo_megatron.rollout.engine import NamedTensor


@runtime_checkable
class Policy(Protocol):
    """What the trainer needs from the model it optimises."""

    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad pass: ``(logprobs, entropy)``, both ``[B, S]`` fp32 nats on CPU, 0 off ``response_mask``.

        Log-probs at ``temperature``, entropy at ``entropy_temperature`` (None: the same), from one forward.
        """
        ...

    def train_step(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """One optimizer step on ``batch`` (advantages and token weights filled); metrics identical on every rank."""
        ...

    def iter_hf_weights(self) -> Iterator[NamedTensor]:
        """Stream ``(hf_name, full_tensor)`` of the current weights (every model-parallel rank must drain it)."""
        ...

    def save_checkpoint(self, path: str, trainer_state: dict) -> None:
        """Save the model, optimizer and ``trainer_state`` (plain values) to the folder ``path``; all ranks call.

        The folder must end complete in ``run_dir``'s sense (``run_dir.mark_complete`` after the last file).
        """
        ...

    def load_checkpoint(self, path: str) -> dict:
        """Load a checkpoint folder written by ``save_checkpoint``; returns its trainer state; all ranks call."""
        ...

    def offload_train_state(self) -> None:
        """Move gradient buffers and optimizer states off the accelerator while the engine generates."""
        ...

    def restore_train_state(self) -> None:
        """Undo ``offload_train_state`` before the next pass."""
        ...


@runtime_checkable
class ReferencePolicy(Protocol):
    """The frozen reference policy of the KL term (``megatron_adapter.reference.FrozenReference`` is the real one)."""

    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad pass of the initial weights, as ``Policy.compute_logprobs``."""
        ...
