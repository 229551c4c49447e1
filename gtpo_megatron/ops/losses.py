"""The policy-gradient loss of GTPO, GRPO, DAPO and Dr. GRPO, with an externally supplied global normaliser.

docs/algorithm.md sections 1 (objective, ratio, one normaliser per step, filtered completions still count) and 5
(what each loss allows, checked when its :class:`LossSpec` is built). :func:`policy_loss` returns this
micro-batch's *contribution* to the step loss: the caller computes ``normalizer`` once per step
(:func:`compute_normalizer` summed, then ``parallel.global_normalizer``) and never divides again. Per token
``l = -min(r A, clip(r) A) * w`` (+ ``kl_coef * KL``); ``seq-mean-token-mean`` sums each row's token mean,
the other aggregations the tokens. Rows removed from the objective arrive with an all-False ``response_mask``
(``TrainBatch.loss_mask``). B sequences, T token columns. Pure torch: no collectives, no ``.item()``, inputs
never modified; metrics are detached fp32 sums and counts (``loss_metrics.policy_loss_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.choices import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    KL_LOSSES,
    LOSS_NAMES,
    OFF_POLICY_CAP_MIN,
    OFF_POLICY_CORRECTIONS,
    REQUIRED_AGGREGATION,
)
from gtpo_megatron.ops.entropy_filter import LN2
from gtpo_megatron.ops.loss_metrics import policy_loss_metrics


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """The step objective: which loss, its aggregation and clip range, temperatures and the entropy terms.

    Built by ``algorithm.build_loss_spec``; the entropy defaults switch the filter and penalty off.

    Attributes:
        loss_name: one of :data:`LOSS_NAMES` (docs/algorithm.md section 5 defines what each allows).
        aggregation: one of :data:`AGGREGATIONS`; also selects the normaliser (:func:`compute_normalizer`).
        clip_eps_low, clip_eps_high: PPO clip range ``[1 - low, 1 + high]`` of the ratio (>= 0).
        kl_coef: KL coefficient beta (0: no term); ``kl_estimator``: one of :data:`KL_ESTIMATORS`, Schulman's
            k1 ``-x``, k2 ``x^2 / 2``, k3 ``exp(x) - x - 1`` with ``x = log pi_ref - log pi_theta``.
        temperature: softmax temperature (> 0) of the training log-probs (``algorithm.loss_temperature``).
        max_response_length: Dr. GRPO's constant L of the normaliser, else None.
        entropy_temperature: temperature of the token entropy (<H>_i of the filter and penalty); None: ``temperature``.
        entropy_filter, entropy_threshold, initial_entropy, entropy_only_negative: the filter delta_i
            (``entropy_filter.entropy_keep_mask``'s ``mode``, ``threshold``, <H>_ini, ``only_negative``).
        entropy_penalty: gamma of ``A_i - gamma * <H>_i`` (0: none).
        off_policy_correction: one of :data:`OFF_POLICY_CORRECTIONS` (docs/algorithm.md section 11; ``none``: no
            importance weight); ``off_policy_cap``: its cap C (>= 1, ``choices.OFF_POLICY_CAP_MIN``).

    Raises:
        ValueError: an unknown name, aggregation, estimator or correction, a negative clip range, a cap below 1, a KL
            term for ``gtpo`` / ``dapo``, ``dapo`` without ``token-mean`` or ``dr_grpo`` without
            ``seq-mean-token-sum``.
    """

    loss_name: str
    aggregation: str
    clip_eps_low: float
    clip_eps_high: float
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    max_response_length: int | None = None
    entropy_temperature: float | None = None
    entropy_filter: str = "off"
    entropy_threshold: float = LN2
    initial_entropy: float | None = None
    entropy_only_negative: bool = False
    entropy_penalty: float = 0.0
    off_policy_correction: str = "none"
    off_policy_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.loss_name not in LOSS_NAMES:
            raise ValueError(f"unknown loss_name {self.loss_name!r}; choose one of {list(LOSS_NAMES)}")
        _check_aggregation(self.aggregation)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; choose one of {list(KL_ESTIMATORS)}")
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"unknown off_policy_correction {self.off_policy_correction!r}; choose one of "
                f"{list(OFF_POLICY_CORRECTIONS)}"
            )
        if not self.off_policy_cap >= OFF_POLICY_CAP_MIN:
            raise ValueError(f"off_policy_cap={self.off_policy_cap} must be >= {OFF_POLICY_CAP_MIN}; use 2.0")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high} must both be >= 0")
        if self.kl_coef != 0.0 and self.loss_name not in KL_LOSSES:
            raise ValueError(f"{self.loss_name} has no KL term; got kl_coef={self.kl_coef}, set 0")
        required = REQUIRED_AGGREGATION.get(self.loss_name, self.aggregation)
        if self.aggregation != required:
            raise ValueError(f"{self.loss_name} uses aggregation={required!r}; got {self.aggregation!r}")


def compute_normalizer(
    response_mask: torch.Tensor, aggregation: str, *, max_response_length: int | None = None
) -> torch.Tensor:
    """This micro-batch's fp32 count for ``aggregation``; the caller sums it over the step and all-reduces.

    Response tokens of ``response_mask`` (``[B, T]`` bool, the loss mask) for ``token-mean``, else sequences with
    a response token, times Dr. GRPO's constant ``max_response_length`` when given.

    Raises:
        ValueError: unknown ``aggregation``, or ``max_response_length`` given with another aggregation or < 1.
    """
    _check_aggregation(aggregation)
    if aggregation == "token-mean":
        if max_response_length is not None:
            raise ValueError("max_response_length applies only to aggregation='seq-mean-token-sum'; drop it")
        return response_mask.sum(dtype=torch.float32)
    num_sequences = response_mask.any(dim=-1).sum(dtype=torch.float32)
    if max_response_length is None:
        return num_sequences
    if aggregation != "seq-mean-token-sum" or max_response_length < 1:
        raise ValueError(
            f"max_response_length={max_response_length} needs aggregation='seq-mean-token-sum' (got "
            f"{aggregation!r}) and a value >= 1"
        )
    return num_sequences * float(max_response_length)


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {list(AGGREGATIONS)}")


def _check_shapes(
    policy_logprobs, advantages, token_weights, response_mask, old_logprobs, ref_logprobs, is_weights
) -> None:
    shape = tuple(policy_logprobs.shape)
    if policy_logprobs.dim() != 2:
        raise ValueError(f"policy_logprobs must be [B, T]; got shape {shape}")
    named = {"token_weights": token_weights, "response_mask": response_mask}
    optional = (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("is_weights", is_weights))
    named.update({k: v for k, v in optional if v is not None})
    for name, tensor in named.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must match policy_logprobs {shape}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [B] = ({shape[0]},)")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be bool (True = response token); got {response_mask.dtype}")


def _masked(values: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))


def _kl_per_token(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    log_ratio = ref_logprobs - policy_logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(log_ratio) - log_ratio - 1.0  # k3 (LossSpec admits no other)


def _aggregate(token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: torch.Tensor):
    total = token_loss.sum(dim=-1)
    if aggregation == "seq-mean-token-mean":
        total = total / mask.sum(dim=-1).clamp(min=1)
    return total.sum() / normalizer


def policy_loss(
    *,
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    response_mask: torch.Tensor,
    normalizer: torch.Tensor,
    spec: LossSpec,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's contribution to the step loss, and its metric sums; fp32.

    ``policy_logprobs`` (differentiable), ``old_logprobs`` (None: ratio 1 with gradient), ``ref_logprobs``,
    ``token_weights``, ``entropy`` (metrics only), ``response_mask`` (bool), ``is_weights`` (the detached
    off-policy weights of ``off_policy.importance_weights``; None: none): ``[B, T]``; ``advantages`` and
    ``keep_mask`` (metrics only): ``[B]``; ``normalizer`` a scalar > 0. KL is weighted by neither ``w`` nor
    ``is_weights``.

    Raises:
        ValueError: shape mismatches, a non-bool mask, ``spec.kl_coef > 0`` without ``ref_logprobs``.
    """
    _check_shapes(policy_logprobs, advantages, token_weights, response_mask, old_logprobs, ref_logprobs, is_weights)
    if spec.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={spec.kl_coef} > 0 needs ref_logprobs; pass them or set kl_coef=0")
    mask_BT = response_mask
    logprobs_BT = _masked(policy_logprobs, mask_BT)  # padding may hold anything, even NaN: never reaches the grad
    old_BT = logprobs_BT.detach() if old_logprobs is None else _masked(old_logprobs, mask_BT)
    ratio_BT = torch.exp(logprobs_BT - old_BT)
    adv_B1 = advantages.float().unsqueeze(-1)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = torch.clamp(ratio_BT, 1.0 - spec.clip_eps_low, 1.0 + spec.clip_eps_high) * adv_B1
    token_loss_BT = -torch.minimum(unclipped_BT, clipped_BT) * _masked(token_weights, mask_BT)
    if is_weights is not None:
        token_loss_BT = token_loss_BT * _masked(is_weights, mask_BT)
    kl_BT = None
    if spec.kl_coef > 0:
        kl_BT = _kl_per_token(logprobs_BT, _masked(ref_logprobs, mask_BT), spec.kl_estimator)
        token_loss_BT = token_loss_BT + spec.kl_coef * kl_BT
    loss = _aggregate(token_loss_BT, mask_BT, spec.aggregation, normalizer)
    metrics = policy_loss_metrics(
        ratio=ratio_BT,
        clipped_mask=clipped_BT < unclipped_BT,
        advantages=advantages,
        token_weights=token_weights,
        response_mask=mask_BT,
        kl=kl_BT,
        entropy=entropy,
        keep_mask=keep_mask,
    )
    return loss, metrics
