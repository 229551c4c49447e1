"""Policy-gradient losses (GTPO, GRPO, DAPO, Dr. GRPO) with an externally supplied global normaliser.

docs/algorithm.md sections 1 and 5. Every loss shares one keyword-only signature (:class:`PolicyLossFn`) and returns
``(loss, metrics)`` where ``loss`` is this micro-batch's *contribution* to the step objective: summing ``loss``
over every micro-batch and data-parallel rank of one optimizer step gives the step's loss. The caller therefore
computes ``normalizer`` once per step (``compute_normalizer`` on the step's rows, summed, then all-reduced over the
data-parallel group: ``gtpo_megatron.parallel.global_normalizer``, which ``MegatronPolicy.forward_backward`` calls)
and never divides again.

Aggregations (the per-token term is ``l_{i,t} = -min(r A, clip(r) A) * w_{i,t}``, plus the optional KL term):
- ``seq-mean-token-mean``: ``sum_i (sum_t l_{i,t} / |o_i|) / normalizer``; normaliser = number of sequences
  (rows with at least one response token) in the step. GTPO default (docs/algorithm.md section 1).
- ``token-mean``: ``sum_{i,t} l_{i,t} / normalizer``; normaliser = number of response tokens in the step (DAPO).
- ``seq-mean-token-sum``: ``sum_{i,t} l_{i,t} / normalizer``; normaliser = number of sequences, or for Dr. GRPO
  the constant ``num_sequences * max_response_length`` (``compute_normalizer(..., max_response_length=L)``).

Which rows count (every aggregation): the loss and its normaliser see the rows of ``response_mask``. A row that a
switch removes from the objective (``algorithm.skip_uniform_groups``: a group whose rewards are all equal;
``algorithm.overlong_filter``: a truncated completion) must arrive with an all-False ``response_mask`` row
(``TrainBatch.loss_mask``): it then counts in no normaliser (neither its tokens nor its sequence) and no term of the
loss, KL included, acts on it, so the kept rows' gradients do not shrink with the number of removed rows. A
completion dropped by the entropy filter is NOT removed: docs/algorithm.md section 1 writes the objective as
``(1/G) sum_i delta_i (...)`` over all G completions, with ``delta_i = 0`` inside the sum, so it keeps its
``response_mask`` and counts in the normaliser (as a sequence and, with ``token-mean``, with its tokens); only its
``token_weights`` are 0.

Ratio: with ``old_logprobs=None`` (one update per batch, the paper's setting) ``r = exp(logp - stopgrad(logp))``,
which is exactly 1 with the policy gradient attached; otherwise ``r = exp(policy_logprobs - old_logprobs)`` clipped
PPO-style to ``[1 - clip_eps_low, 1 + clip_eps_high]``.

Metrics: detached fp32 SUMS and COUNTS over this micro-batch (see ``loss_metrics.policy_loss_metrics`` for the
keys), so the caller all-reduces them with SUM and divides afterwards.

Dimension legend: P prompts, G group size, B = P*G sequences, T response tokens (padded; any layout: a full
``[B, S]`` sequence layout works too since everything is masked by ``response_mask``).
Pure torch: no collectives, no ``.item()``, inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from gtpo_megatron.ops.entropy_filter import LN2
from gtpo_megatron.ops.loss_metrics import policy_loss_metrics

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


class PolicyLossFn(Protocol):
    """Signature shared by every entry of :data:`POLICY_LOSS_REGISTRY`.

    Args:
        policy_logprobs: ``[B, T]`` fp32 log pi_theta of each response token (nats), differentiable.
        old_logprobs: ``[B, T]`` fp32 log pi_old (nats, no gradient), or None for one update per batch.
        advantages: ``[B]`` per-sequence advantage (after the entropy penalty, docs/algorithm.md section 4).
        token_weights: ``[B, T]`` per-token multiplier (conflict lambda times the filter's delta, section 3-4);
            baselines pass ``response_mask.float()``.
        response_mask: ``[B, T]`` bool, True on response tokens (the tokens the loss acts on).
        normalizer: scalar tensor (> 0), the step's global count for ``aggregation`` (module docstring).
        aggregation: one of :data:`AGGREGATIONS`.
        clip_eps_low, clip_eps_high: PPO clip range ``[1 - low, 1 + high]`` of the ratio.
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the KL term, or None.
        kl_coef: KL coefficient beta (0 disables the term).
        kl_estimator: one of :data:`KL_ESTIMATORS`, Schulman's estimators of KL(pi_theta || pi_ref) from samples
            of pi_theta with ``x = log pi_ref - log pi_theta``: ``"k1"`` = ``-x`` (unbiased, can be negative),
            ``"k2"`` = ``x^2 / 2`` (biased, low variance), ``"k3"`` = ``exp(x) - x - 1`` (unbiased, >= 0).
        entropy: optional ``[B, T]`` token entropy (nats) for the ``entropy_sum`` metric only.
        entropy_keep_mask: optional ``[B]`` bool filter decisions for the filter metrics only.

    Returns:
        ``(loss, metrics)``: fp32 scalar loss with gradient w.r.t. ``policy_logprobs``; dict of detached sums.
    """

    def __call__(
        self,
        *,
        policy_logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        token_weights: torch.Tensor,
        response_mask: torch.Tensor,
        normalizer: torch.Tensor,
        aggregation: str,
        clip_eps_low: float,
        clip_eps_high: float,
        ref_logprobs: torch.Tensor | None = None,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        entropy: torch.Tensor | None = None,
        entropy_keep_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and its metric sums (see the class docstring)."""
        ...


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator adding a loss to :data:`POLICY_LOSS_REGISTRY`.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSS_REGISTRY:
            raise ValueError(f"policy loss {name!r} is already registered; choose another name")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered loss called ``name``.

    Raises:
        ValueError: for an unknown name, listing the available ones.
    """
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """The step objective's settings: loss, aggregation, temperatures and the per-completion entropy terms.

    The entropy terms (filter and penalty, docs/algorithm.md section 4) are applied by ``objective.policy_objective``
    inside the training forward. Plain values, shared by every micro-batch of a step; ``algorithm.build_loss_spec``
    builds the production one from the algorithm and rollout config sections (the trainer fills
    ``initial_entropy`` once it is measured). The defaults of the entropy fields switch those terms off (a plain
    GRPO-style objective).

    Attributes:
        loss_name: key of :data:`POLICY_LOSS_REGISTRY` (``gtpo``, ``grpo``, ``dapo``, ``dr_grpo``).
        aggregation: one of :data:`AGGREGATIONS`; also selects the normaliser (:func:`compute_normalizer`).
        clip_eps_low, clip_eps_high: PPO clip range ``[1 - low, 1 + high]`` of the ratio.
        kl_coef: KL coefficient beta (0 disables the term); ``kl_estimator``: one of :data:`KL_ESTIMATORS`.
        temperature: softmax temperature of the training log-probs (> 0): the sampling temperature (pi_theta is
            the distribution the completions were drawn from) or 1 (the authors' code), ``algorithm.
            loss_temperature``.
        max_response_length: Dr. GRPO's constant L of the normaliser (``compute_normalizer``), else None.
        entropy_temperature: temperature of the token entropy the loss computes with the log-probs (docs/algorithm.md
            section 4; the per-completion mean <H>_i feeds the filter and the penalty); None: ``temperature``.
        entropy_filter, entropy_threshold, initial_entropy, entropy_only_negative: the entropy filter delta_i
            (``entropy_filter.entropy_keep_mask``'s ``mode``, ``threshold``, ``initial_entropy`` (<H>_ini of the
            ``paper`` mode, known before the step) and ``only_negative``); ``"off"`` keeps every completion.
        entropy_penalty: gamma of the penalised advantage ``A_i - gamma * <H>_i`` (0: none).
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


def compute_normalizer(
    response_mask: torch.Tensor, aggregation: str, *, max_response_length: int | None = None
) -> torch.Tensor:
    """This micro-batch's local count for ``aggregation``; the caller sums it over the step and all-reduces.

    Args:
        response_mask: ``[B, T]`` bool, True on response tokens of the rows in the objective (module docstring:
            removed rows all False, entropy-filtered rows unchanged).
        aggregation: one of :data:`AGGREGATIONS`.
        max_response_length: Dr. GRPO's constant: with ``seq-mean-token-sum`` the count becomes
            ``num_sequences * max_response_length`` (tokens budget), independent of the sampled lengths.

    Returns:
        fp32 scalar: number of response tokens (``token-mean``) or of sequences with at least one response token
        (the ``seq-mean-*`` modes), times ``max_response_length`` when given.

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
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {list(KL_ESTIMATORS)}")


def _aggregate(token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: torch.Tensor):
    total = token_loss.sum(dim=-1)
    if aggregation == "seq-mean-token-mean":
        total = total / mask.sum(dim=-1).clamp(min=1)
    return total.sum() / normalizer


def clipped_surrogate_loss(
    *,
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    response_mask: torch.Tensor,
    normalizer: torch.Tensor,
    aggregation: str,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_keep_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The shared clipped-surrogate objective behind every registry entry (see :class:`PolicyLossFn`).

    Per token: ``l = -min(r * A, clip(r, 1 - low, 1 + high) * A) * w + kl_coef * KL`` on response tokens (the KL
    term is not weighted by ``w``), aggregated as the module docstring says. Computed in fp32.

    Raises:
        ValueError: shape mismatches, a non-bool mask, unknown aggregation or KL estimator, negative clip eps,
            ``kl_coef > 0`` without ``ref_logprobs``.
    """
    _check_aggregation(aggregation)
    _check_shapes(policy_logprobs, advantages, token_weights, response_mask, old_logprobs, ref_logprobs)
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps_low={clip_eps_low}, clip_eps_high={clip_eps_high} must both be >= 0")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logprobs; pass them or set kl_coef=0")
    mask_BT = response_mask
    logprobs_BT = _masked(policy_logprobs, mask_BT)  # padding may hold anything, even NaN: never reaches the grad
    old_BT = logprobs_BT.detach() if old_logprobs is None else _masked(old_logprobs, mask_BT)
    ratio_BT = torch.exp(logprobs_BT - old_BT)
    adv_B1 = advantages.float().unsqueeze(-1)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = torch.clamp(ratio_BT, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv_B1
    token_loss_BT = -torch.minimum(unclipped_BT, clipped_BT) * _masked(token_weights, mask_BT)
    kl_BT = None
    if kl_coef > 0:
        kl_BT = _kl_per_token(logprobs_BT, _masked(ref_logprobs, mask_BT), kl_estimator)
        token_loss_BT = token_loss_BT + kl_coef * kl_BT
    loss = _aggregate(token_loss_BT, mask_BT, aggregation, normalizer)
    metrics = policy_loss_metrics(
        ratio=ratio_BT,
        clipped_mask=clipped_BT < unclipped_BT,
        advantages=advantages,
        token_weights=token_weights,
        response_mask=mask_BT,
        kl=kl_BT,
        entropy=entropy,
        entropy_keep_mask=entropy_keep_mask,
    )
    return loss, metrics


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@register_policy_loss("gtpo")
def gtpo_loss(**kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GTPO (docs/algorithm.md section 1): conflict/filter weights in ``token_weights``, no KL term.

    Raises:
        ValueError: ``kl_coef > 0`` (GTPO has no reference model), plus the shared checks.
    """
    _require(kwargs.get("kl_coef", 0.0) == 0.0, f"gtpo has no KL term; got kl_coef={kwargs.get('kl_coef')}, set 0")
    return clipped_surrogate_loss(**kwargs)


@register_policy_loss("grpo")
def grpo_loss(**kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO (docs/algorithm.md section 5): clipped ratio, optional k1/k3 KL to ``ref_logprobs`` with ``kl_coef``."""
    return clipped_surrogate_loss(**kwargs)


@register_policy_loss("dapo")
def dapo_loss(**kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO (docs/algorithm.md section 5): clip-higher (pass e.g. 0.2/0.28), token-mean over the step, no KL.

    Raises:
        ValueError: ``aggregation != "token-mean"`` or ``kl_coef > 0``.
    """
    _require(
        kwargs.get("aggregation") == "token-mean",
        f"dapo uses aggregation='token-mean'; got {kwargs.get('aggregation')!r}",
    )
    _require(kwargs.get("kl_coef", 0.0) == 0.0, f"dapo has no KL term; got kl_coef={kwargs.get('kl_coef')}, set 0")
    return clipped_surrogate_loss(**kwargs)


@register_policy_loss("dr_grpo")
def dr_grpo_loss(**kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr. GRPO (docs/algorithm.md section 5): token sums over a constant normaliser (no per-length division).

    Pair with mean-centred advantages (``group_mean``) and a normaliser from
    ``compute_normalizer(mask, "seq-mean-token-sum", max_response_length=L)``.

    Raises:
        ValueError: ``aggregation != "seq-mean-token-sum"``.
    """
    _require(
        kwargs.get("aggregation") == "seq-mean-token-sum",
        f"dr_grpo uses aggregation='seq-mean-token-sum'; got {kwargs.get('aggregation')!r}",
    )
    return clipped_surrogate_loss(**kwargs)
