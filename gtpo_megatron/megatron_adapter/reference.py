"""The frozen reference policy of the GRPO KL term (docs/algorithm.md section 9): the initial weights, forward only.

A ``MegatronPolicy`` built with ``trainable=False`` from the same checkpoint, model section and layout (no DDP, no
gradients, no optimizer state), whose log-probs go through the same schedule and op: at step 1 the KL is 0. It is
rebuilt at every start and never checkpointed. With ``offload`` on CUDA its weights stay in host memory between
passes (one host-to-device copy per step). With ``model.lora`` the reference is :class:`AdaptersOffReference`: the
policy's own frozen base, its adapters skipped (no second copy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

if TYPE_CHECKING:
    from gtpo_megatron.batch import TrainBatch
    from gtpo_megatron.megatron_adapter.settings import PolicySettings
    from gtpo_megatron.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


class FrozenReference:
    """Forward-only copy of the initial policy; ``offload`` keeps it in host memory (CUDA only)."""

    def __init__(self, policy: MegatronPolicy, *, offload: bool = False) -> None:
        self.policy = policy
        self.device = policy.device
        self.offload = offload and self.device.type == "cuda"
        if self.offload:
            policy.model.to("cpu")

    @classmethod
    def from_pretrained(
        cls, settings: PolicySettings, *, groups: ParallelGroups, offload: bool = False
    ) -> FrozenReference:
        """This rank's frozen stage from the policy's ``settings`` (errors as the policy's)."""
        policy = MegatronPolicy.from_pretrained(settings, groups=groups, trainable=False)
        if offload and policy.device.type != "cuda":
            logger.warning("algorithm.kl_reference_offload=true has no effect without CUDA")
        return cls(policy, offload=offload)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S]`` fp32 log-probs (nats, CPU) of the initial weights.

        Collectives: those of ``MegatronPolicy.compute_logprobs``.
        """
        if self.offload:
            self.policy.model.to(self.device)
        try:
            return self.policy.compute_logprobs(batch, temperature=temperature, entropy_temperature=entropy_temperature)
        finally:
            if self.offload:
                self.policy.model.to("cpu")


class AdaptersOffReference:
    """The KL reference of a LoRA policy: the policy's own model with its adapters switched off (the base weights)."""

    def __init__(self, policy: MegatronPolicy) -> None:
        self.policy = policy

    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S]`` fp32 log-probs and entropies (nats, CPU) of the base model; collectives as the policy's pass."""
        from gtpo_megatron.megatron_adapter.lora import adapters_off

        with adapters_off(self.policy.model):
            return self.policy.compute_logprobs(batch, temperature=temperature, entropy_temperature=entropy_temperature)
