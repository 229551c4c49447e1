"""Rollout routing replay (R3, arXiv 2510.11370): the training forwards route each token to the engine's experts.

Megatron's contract (megatron-core 0.16.1 and 0.19.2, ``moe_utils.topk_routing_with_score_function``): a
``TopKRouter`` whose ``router_replay`` attribute is set takes its top-k from
``router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)``, which returns
``(values [T, K], indices [T, K] int64)``, the values being ``scores`` at the indices. Here each router of one model
gets its own :class:`LayerReplay` (Megatron's ``RouterReplay`` keeps every instance in one process-wide list, which a
policy and its KL reference would share), and :class:`RoutingReplay` feeds them per micro-batch:

* the values are gathered from the router's own scores at the replayed experts, so the routing weights and their
  gradient (to the router) are the trainer's; only the choice of experts is the engine's;
* a token without a record (``TrainBatch.routed_experts`` 0: padding, the last sampled token) keeps the router's
  own top-k;
* tokens reach the router as ``[S/tp (sequence parallel), b]`` flattened sequence-major, so a micro-batch's
  ``[b, S, L, K]`` record is transposed, cut to this TP rank's sequence chunk and flattened the same way; the
  router's ``layer_number`` (1-based, global over pipeline stages) picks its layer;
* with full recompute (``model.recompute=full``, or selective recompute of Megatron's ``moe`` module) a router's
  forward runs twice, first under ``no_grad`` inside Megatron's checkpoint and again with gradients in the
  backward. Backwards come in forward order in Megatron's schedules (no pipelining, 1F1B), so each training forward
  queues its experts and each recompute takes the oldest: both runs route alike (:func:`recomputes_routers`).

The routing agreement (tokens whose trainer top-k set equals the engine's / recorded tokens) is counted on the first
run of each forward. No collectives; ``agreement`` leaves the reduction to the caller.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable

import torch

from gtpo_megatron.megatron_adapter.moe.features import moe_shape


def check_replay_supported(hf_config) -> None:
    """Refuse ``rollout.routing_replay=rollout`` before any weight is read where it cannot run.

    Raises:
        ValueError: ``hf_config`` is a dense model.
        RuntimeError: the installed megatron-core's top-k routing has no ``router_replay`` hook (added in 0.16).
    """
    if moe_shape(hf_config) is None:
        raise ValueError(
            f"rollout.routing_replay='rollout': model_type={hf_config.model_type!r} is a dense model, with no experts "
            "to replay; set rollout.routing_replay=off"
        )
    from megatron.core.transformer.moe import moe_utils

    if "router_replay" not in inspect.signature(moe_utils.topk_routing_with_score_function).parameters:
        import megatron.core

        raise RuntimeError(
            f"rollout.routing_replay='rollout' needs megatron-core's routing replay hook (router_replay in "
            f"topk_routing_with_score_function), which megatron-core {megatron.core.__version__} lacks; install "
            "megatron-core>=0.16.1 or set rollout.routing_replay=off"
        )


def router_targets(routed_experts: torch.Tensor, layer: int, chunk: tuple[int, int]) -> torch.Tensor:
    """One router's ``[T, K]`` int64 targets (-1: no record) from a micro-batch's ``[b, S, L, K]`` record.

    Tokens in the router's order: ``[S, b]`` flattened sequence-major, cut to chunk ``rank`` of ``size`` along ``S``
    (``chunk = (rank, size)``; sequence parallelism, else ``(0, 1)``), so ``T = S / size * b``.
    """
    rank, size = chunk
    tokens_SbK = (routed_experts[:, :, layer].long() - 1).transpose(0, 1)
    tokens_SbK = tokens_SbK.chunk(size, dim=0)[rank]
    return tokens_SbK.reshape(-1, tokens_SbK.shape[-1])


def recomputes_routers(config) -> bool:
    """Whether the backward re-runs the routers of a ``TransformerConfig``'s layers (full, or selective ``moe``)."""
    if config.recompute_granularity == "full":
        return True
    return config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ())


class LayerReplay:
    """The replay state of one router (duck-types Megatron's ``RouterReplay.get_replay_topk``).

    Args:
        layer: 0-based global index of the router's layer (``routed_experts[:, :, layer]``).
        recompute: the model recomputes full layers in the backward (module docstring).
    """

    def __init__(self, layer: int, *, recompute: bool) -> None:
        self.layer = layer
        self.recompute = recompute
        self.target: torch.Tensor | None = None
        """``[T, K]`` int64 engine experts of the next forward's tokens, -1: none; None: no replay."""
        self.training = False
        self.pending: deque[torch.Tensor | None] = deque()
        self.agreement = torch.zeros(2, dtype=torch.float64)
        """``[matched, recorded]`` token counts since the last ``RoutingReplay.agreement``."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [T, K] at the experts, experts [T, K] int64)``: the engine's where recorded, else the router's.

        Raises:
            ValueError: the target's token count differs from ``scores``'s (a layout mismatch).
        """
        own_values, own_experts = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.recompute and torch.is_grad_enabled()
        target = self.pending.popleft() if recomputing else self.target
        if not recomputing and self.recompute and self.training:
            self.pending.append(target)
        if target is None:
            return own_values, own_experts
        if target.shape != own_experts.shape:
            raise ValueError(
                f"layer {self.layer}: replayed experts {tuple(target.shape)} for router scores of {tuple(scores.shape)}"
                "; the micro-batch's routed_experts must follow its input_ids column for column"
            )
        target = target.to(scores.device)
        recorded = target[:, :1] >= 0
        if not recomputing:
            self._count(own_experts, target, recorded)
        experts = torch.where(recorded, target, own_experts)
        return scores.gather(1, experts), experts

    def _count(self, own: torch.Tensor, target: torch.Tensor, recorded: torch.Tensor) -> None:
        """Add the recorded tokens and those whose own top-k set equals the target set to ``agreement``."""
        same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & recorded[:, 0]
        counts = torch.stack([same.sum(), recorded.sum()]).to(torch.float64)
        self.agreement = self.agreement.to(counts.device) + counts


class RoutingReplay:
    """Drives the routers of one model stage from ``TrainBatch.routed_experts`` (module docstring).

    Args:
        model: the stage (a ``GPTModel``, DDP-wrapped or not); every ``TopKRouter`` in it gets a ``LayerReplay``.
        recompute: :func:`recomputes_routers` of the stage's config.
        tp_rank, tp_size: this rank's tensor-parallel coordinates; ``sequence_parallel``: tokens are cut over TP.

    Raises:
        ValueError: the model has no routers (a dense model).
    """

    def __init__(self, model, *, recompute: bool, tp_rank: int, tp_size: int, sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("rollout.routing_replay=rollout on a model without MoE routers; set it to off")
        self.layers = []
        for router in routers:
            router.router_replay = LayerReplay(router.layer_number - 1, recompute=recompute)
            self.layers.append(router.router_replay)
        self.chunk = (tp_rank, tp_size) if sequence_parallel else (0, 1)

    def begin_pass(self, *, training: bool) -> None:
        """Start the micro-batches of one schedule run (``training``: gradients, so recomputes may follow).

        Resets the agreement counts: ``agreement`` after the run reports that run alone.
        """
        for layer in self.layers:
            layer.training = training
            layer.pending.clear()
            layer.agreement = torch.zeros(2, dtype=torch.float64)

    def set_micro_batch(self, routed_experts: torch.Tensor | None) -> None:
        """Targets of the next forward from its ``[b, S, L, K]`` record (``TrainBatch.routed_experts``); None: own."""
        for layer in self.layers:
            layer.target = None if routed_experts is None else router_targets(routed_experts, layer.layer, self.chunk)

    def end_pass(self) -> None:
        """Drop the targets (a later pass without records routes on its own).

        Raises:
            RuntimeError: a recompute is still queued (the schedule's backwards did not follow its forwards).
        """
        left = sum(len(layer.pending) for layer in self.layers)
        for layer in self.layers:
            layer.target, layer.training = None, False
            layer.pending.clear()
        if left:
            raise RuntimeError(f"routing replay: {left} recomputed layer forwards never ran; the schedule skipped them")

    def agreement(self) -> torch.Tensor:
        """``[matched, recorded]`` float64 (CPU) token-layer counts of the last run, summed over this stage's layers."""
        return sum((layer.agreement.cpu() for layer in self.layers), torch.zeros(2, dtype=torch.float64))
