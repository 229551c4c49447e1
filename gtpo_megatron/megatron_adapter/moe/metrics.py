"""Router metrics of a mixture-of-experts training pass: the experts' load and the router's auxiliary losses.

``RouterLoad`` counts the tokens every router sends to each expert during the training forward (a forward hook on
each Megatron ``Router``: its routing map ``[tokens, E]``; only with gradients enabled, so the no-grad log-prob pass
and the no-grad first pass of activation recompute are not counted). After the pass the counts ``[L, E]`` are summed
over the world (each rank routes its own tokens: its DP rows, its sequence slice under SP; each layer lives on one
stage) and divided by a uniform load ``tokens * k / E``:

* ``moe_expert_load_max`` / ``moe_expert_load_min``: the largest and smallest expert load over every layer (1.0
  and 1.0: perfectly balanced; forward tokens, padding included).

Megatron's router records its load-balancing and z-losses (when ``model.moe_aux_loss_coeff`` / ``moe_z_loss_coeff``
are > 0) in its layer-wise tracker, summed over micro-batches: ``moe_aux_loss`` / ``moe_z_loss`` are their means over
layers, micro-batches and ranks. Their gradients enter outside the GTPO loss and its normaliser, each micro-batch's
weighted by its share of the step's tokens (``router_losses``; docs/moe.md).
"""

from __future__ import annotations

import torch

from gtpo_megatron.parallel.collectives import all_reduce_

_TRACKED = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}


class RouterLoad:
    """Per-layer expert token counts of one training pass over ``model``'s routers (``num_layers`` global layers).

    Collectives: :meth:`metrics` issues one SUM all-reduce of ``[L, E]`` (and one per tracked loss) on ``world``.
    """

    def __init__(self, model, *, num_layers: int, num_experts: int) -> None:
        from megatron.core.transformer.moe.router import Router

        self.shape = (num_layers, num_experts)
        self.counts_LE: torch.Tensor | None = None  # int64, on the routers' device (no host sync per layer)
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if torch.is_grad_enabled():
            routing_map = outputs[1]
            if self.counts_LE is None:
                self.counts_LE = torch.zeros(self.shape, dtype=torch.int64, device=routing_map.device)
            self.counts_LE[router.layer_number - 1] += routing_map.sum(dim=0)

    def metrics(self, *, world, num_micro_batches: int, stage_ranks: int) -> dict[str, float]:
        """The module's metrics of the pass since the last call, identical on every rank; resets the counts.

        ``world``: every training rank (None: this process alone); ``stage_ranks``: ranks per pipeline stage (the
        tracked losses' mean divides by them); ``num_micro_batches``: this rank's in the pass.
        """
        local = self.counts_LE if self.counts_LE is not None else torch.zeros(self.shape, dtype=torch.int64)
        counts = all_reduce_(local, op="sum", group=world).to("cpu", torch.float64)
        uniform_L1 = counts.sum(dim=1, keepdim=True) / counts.shape[1]
        load = counts / uniform_L1.clamp(min=1.0)
        metrics = {"moe_expert_load_max": float(load.max()), "moe_expert_load_min": float(load.min())}
        local.zero_()
        return {**metrics, **_tracked_losses(world, num_micro_batches, stage_ranks)}


def _tracked_losses(world, num_micro_batches: int, stage_ranks: int) -> dict[str, float]:
    """Means of Megatron's tracked router losses over layers, micro-batches and ranks; clears the tracker."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    metrics = {}
    for name, metric in _TRACKED.items():
        if name in tracker:
            values_L = tracker[name]["values"].detach().to("cpu", torch.float64) / max(num_micro_batches, 1)
            summed = all_reduce_(values_L, op="sum", group=world)
            metrics[metric] = float(summed.mean()) / stage_ranks
    clear_aux_losses_tracker()
    return metrics
