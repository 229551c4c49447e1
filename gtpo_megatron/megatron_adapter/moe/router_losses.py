"""The routers' load-balancing and z-losses weighed per micro-batch by its share of the step's tokens (docs/moe.md).

Megatron scales a micro-batch's router losses ``l_m`` by ``s / M`` (``MoEAuxLossAutoScaler``; ``s``: fp16 loss scale
times ``cp_size``, ``M``: this rank's micro-batches) and DDP averages over ``D`` ranks: ``l_m`` weighs ``1 / (D M_d)``,
which depends on the cut. Here it weighs ``r_m / R`` (its real tokens over the step's, all DP ranks): ``1 / (D M)``
when cut evenly, a sum of 1 however cut, 0 when idle; the scale is ``s D r_m / R``. A hook on each router's output
probabilities sets its micro-batch's scale just before their backward; recompute takes the oldest queued weight.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.parallel.collectives import all_reduce_

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.forward_step import MicroBatch


def real_tokens(micro_batch: MicroBatch) -> int:
    """``r_m``: the micro-batch's ``token_mask`` count; without one, its real rows (``source_rows >= 0``) x width."""
    if micro_batch.token_mask is not None:
        return int(micro_batch.token_mask.sum())
    return sum(row >= 0 for row in micro_batch.source_rows) * micro_batch.input_ids.shape[1]


def router_loss_factors(micro_batches: list[MicroBatch], *, dp_group, dp_size: int) -> list[float]:
    """``D r_m / R`` of each of this rank's ``micro_batches``; all 0 when ``R = 0``.

    Collectives: one SUM all-reduce on ``dp_group`` (None: this process alone).
    """
    tokens = [real_tokens(mb) for mb in micro_batches]
    total = float(all_reduce_(torch.tensor([float(sum(tokens))], dtype=torch.float64), op="sum", group=dp_group)[0])
    return [dp_size * r / total if total > 0 else 0.0 for r in tokens]


def _set_scale(scale: torch.Tensor, grad: torch.Tensor) -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(scale.to(grad.device, copy=True))  # Megatron may keep it and copy_ into it


class RouterLossWeights:
    """Sets the router losses' scale of each micro-batch of a pass (Megatron's legacy loss form, as ``MegatronPolicy``).

    Args:
        model: the stage (unwrapped ``GPTModel``); every ``TopKRouter`` in it gets a forward hook.
        recompute: ``routing_replay.recomputes_routers`` of the stage's config.
    """

    def __init__(self, model, *, recompute: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.recompute = recompute
        self.factors: deque[float] = deque()
        self.current: float | None = None
        self.pending: dict[int, deque[float]] = {}
        for module in model.modules():
            if isinstance(module, TopKRouter):
                self.pending[id(module)] = deque()
                module.register_forward_hook(self._hook)

    def begin_pass(self, factors: list[float]) -> None:
        """Start a training pass whose micro-batches have these ``router_loss_factors``, in schedule order."""
        self.factors = deque(factors)
        self.current = None
        for queue in self.pending.values():
            queue.clear()

    def next_micro_batch(self) -> None:
        """The schedule's next forward is of the next micro-batch (``forward_step`` calls this before it)."""
        self.current = self.factors.popleft() if self.factors else None

    def end_pass(self) -> None:
        """Forget the pass.

        Raises:
            RuntimeError: a recompute is still queued (the schedule's backwards did not follow its forwards).
        """
        left = sum(len(queue) for queue in self.pending.values())
        self.begin_pass([])
        if left:
            raise RuntimeError(f"router losses: {left} recomputed router forwards never ran; the schedule skipped them")

    def _hook(self, router, inputs, outputs) -> None:
        if self.current is None or not router.training:
            return
        if not torch.is_grad_enabled():  # the first forward of a recomputed layer, or a no-grad pass
            if self.recompute:
                self.pending[id(router)].append(self.current)
            return
        factor = self.pending[id(router)].popleft() if self.recompute else self.current
        probs = outputs[0]
        if probs.requires_grad:
            probs.register_hook(partial(_set_scale, _base_scale(router.config, probs.device) * factor))


def _base_scale(config, device: torch.device) -> torch.Tensor:
    """``s``: Megatron's scale of the router losses before its ``1 / M`` (``[1]`` fp32)."""
    one = torch.ones(1, device=device)
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    return scale * config.context_parallel_size
