"""The frozen reference policy of the GRPO KL term (GTPO_SPEC section 5): the initial weights, forward only.

``FrozenReference`` holds a ``MegatronPolicy`` built with ``trainable=False`` from the same HF checkpoint, model
section and TP/PP layout as the trained policy: the same ``GPTModel`` stage (fp32 output layer included), no DDP
wrapper, no gradients, no optimizer state. Its log-probs go through the same schedule and the same fused op as the
policy's own passes (``MegatronPolicy.compute_logprobs``), so at step 1, when the policy still holds the initial
weights, they equal the policy's log-probs and the KL estimate is 0. It is rebuilt from the HF checkpoint at every
start (a resumed run keeps the initial weights as its reference; nothing of it is checkpointed).

Memory: the stage's weights (``params * param_bytes`` per GPU; ``gtpo-plan`` counts them). With ``offload`` on CUDA
the weights live in host memory between passes and move to the GPU for each pass (one host-to-device copy of the
stage per step).
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
    """Forward-only copy of the initial policy; see the module docstring.

    Args:
        policy: a ``MegatronPolicy`` built with ``trainable=False``.
        offload: keep the weights in host memory between passes (CUDA only; a no-op on CPU).
    """

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
        """Build this rank's frozen stage from the policy's own ``settings`` (see ``MegatronPolicy.from_pretrained``).

        Raises:
            ValueError: as ``MegatronPolicy.from_pretrained``.
        """
        policy = MegatronPolicy.from_pretrained(settings, groups=groups, trainable=False)
        if offload and policy.device.type != "cuda":
            logger.warning("algorithm.kl_reference_offload=true has no effect without CUDA")
        return cls(policy, offload=offload)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``MegatronPolicy.compute_logprobs`` of the initial weights (``[B, S]`` fp32 nats on CPU).

        Collectives: those of ``MegatronPolicy.compute_logprobs`` (the schedule's TP/PP traffic, one PP broadcast).
        """
        if self.offload:
            self.policy.model.to(self.device)
        try:
            return self.policy.compute_logprobs(batch, temperature=temperature, entropy_temperature=entropy_temperature)
        finally:
            if self.offload:
                self.policy.model.to("cpu")
