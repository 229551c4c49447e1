"""The policy-gradient loss of GTPO, GRPO, DAPO and Dr. GRPO, with an externally supplied global normaliser.

docs/algorithm.md sections 1 and 5. One function, :func:`policy_loss`, configured by a :class:`LossSpec`, returns
``(loss, metrics)`` where ``loss`` is this micro-batch's *contribution* to the step objective: summing ``loss``
over every micro-batch and data-parallel rank of one optimizer step gives the step's loss. The caller therefore
computes ``normalizer`` once per step (``compute_normalizer`` on the step's rows, summed, then all-reduced over the
data-parallel group: ``parallel.global_normalizer``, which ``MegatronPolicy.forward_backward`` calls) and never
divides again. The four losses differ only in what their :class:`LossSpec` allows (checked when it is built).

Aggregations (the per-token term is ``l_{i,t} = -min(r A, clip(r) A) * w_{i,t}``, plus the optional KL term):
- ``seq-mean-token-mean``: ``sum_i (sum_t l_{i,t} / |o_i|) / normalizer``; normaliser = number of sequences
  (rows with at least one response token) in the step. GTPO default (docs/algorithm.md section 1).
- ``token-mean``: ``sum_{i,t} l_{i,t} / normalizer``; normaliser = number of response tokens in the step (DAPO).
- ``seq-mean-token-sum``: ``sum_{i,t} l_{i,t} / normalizer``; normaliser = number of sequences, or for Dr. GRPO
  the constant ``num_sequences * max_response_length`` (``compute_normalizer(..., max_response_length=L)``).

Which rows count (every aggregation): the loss and its normaliser see the rows of ``response_mask``. A row that a
switch removes from the objective (``skip_uniform_groups``, ``overlong_filter``) arrives with an all-False
``response_mask`` row (``TrainBatch.loss_mask``): it counts in no normaliser and no term of the loss, KL included,
acts on it. A completion dropped by the entropy filter is NOT removed: docs/algorithm.md section 1 writes the
objective as ``(1/G) sum_i delta_i (...)`` over all G completions, so it keeps its ``response_mask`` and counts in
the normaliser; only its ``token_weights`` are 0.

Ratio: with ``old_logprobs=None`` (one update per batch, the paper's setting) ``r = exp(logp - stopgrad(logp))``,
which is exactly 1 with the policy gradient attached; otherwise ``r = exp(policy_logprobs - old_logprobs)`` clipped
PPO-style to ``[1 - clip_eps_low, 1 + clip_eps_high]``.

Metrics: detached fp32 sums and counts (``loss_metrics.policy_loss_metrics``), which the caller all-reduces with
SUM and divides afterwards. Dimension legend: B sequences, T token columns (response or full ``[B, S]`` layout,
everything masked by ``response_mask``). Pure torch: no collectives, no ``.item()``, inputs never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.ops.entropy_filter import LN2
from gtpo_megatron.ops.loss_metrics import policy_loss_metrics

LOSS_NAMES = ("gtpo", "grpo", "dapo", "dr_grpo")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
_REQUIRED_AGGREGATION = {"dapo": "token-mean", "dr_grpo": "seq-mean-token-sum"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """The step objective: which loss, its aggregation and clip range, temperatures and the entropy terms.

    Plain values shared by every micro-batch of a step; ``algorithm.build_loss_spec`` builds it from the config
    (the trainer fills ``initial_entropy`` once measured). The entropy defaults switch the filter and penalty off.

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

    Raises:
        ValueError: an unknown name, aggregation or estimator, a negative clip range, a KL term for ``gtpo`` /
            ``dapo``, ``dapo`` without ``token-mean`` or ``dr_grpo`` without ``seq-mean-token-sum``.
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

    def __post_init__(self) -> None:
        if self.loss_name not in LOSS_NAMES:
            raise ValueError(f"unknown loss_name {self.loss_name!r}; choose one of {list(LOSS_NAMES)}")
        _check_aggregation(self.aggregation)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; choose one of {list(KL_ESTIMATORS)}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high} must both be >= 0")
        if self.kl_coef != 0.0 and self.loss_name in ("gtpo", "dapo"):
            raise ValueError(f"{self.loss_name} has no KL term; got kl_coef={self.kl_coef}, set 0")
        required = _REQUIRED_AGGREGATION.get(self.loss_name, self.aggregation)
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


def _check_shapes(policy_logprobs, advantages, token_weights, response_mask, old_logprobs, ref_logprobs) -> None:
    shape = tuple(policy_logprobs.shape)
    if policy_logprobs.dim() != 2:
        raise ValueError(f"policy_logprobs must be [B, T]; got shape {shape}")
    named = {"token_weights": token_weights, "response_mask": response_mask}
    named.update({k: v for k, v in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)) if v is not None})
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's contribution to the step loss, and its metric sums; fp32.

    Per token ``l = -min(r A, clip(r) A) * w + kl_coef * KL`` on response tokens (KL not weighted by ``w``),
    aggregated as the module docstring says. ``policy_logprobs`` (differentiable), ``old_logprobs`` (None: ratio 1
    with gradient), ``ref_logprobs``, ``token_weights``, ``entropy`` (metrics only) and ``response_mask`` (bool)
    are ``[B, T]``; ``advantages`` and ``keep_mask`` (delta_i, metrics only) ``[B]``; ``normalizer`` a scalar > 0.

    Returns:
        ``(loss, metrics)``: the scalar loss (gradient w.r.t. ``policy_logprobs``) and ``policy_loss_metrics``.

    Raises:
        ValueError: shape mismatches, a non-bool mask, ``spec.kl_coef > 0`` without ``ref_logprobs``.
    """
    _check_shapes(policy_logprobs, advantages, token_weights, response_mask, old_logprobs, ref_logprobs)
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
