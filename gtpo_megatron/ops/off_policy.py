"""Off-policy correction: token-level importance weights of the proximal policy over the behaviour policy.

docs/algorithm.md section 11. The completions were sampled by the behaviour policy mu (the engine's weights, its
log-probs ``rollout_logprobs``); the loss's ratio is taken against the proximal policy pi_prox (``old_logprobs``,
or ``stopgrad(log pi_theta)`` with one update per batch). The decoupled-PPO correction multiplies each token's
surrogate by the detached weight ``rho = pi_prox / mu``, bounded by the cap C:

    tis: w = min(rho, C)          (truncated IS)
    mis: w = rho * [rho <= C]     (masked IS: a token whose rho exceeds C leaves the objective)

An undefined rho (NaN: a NaN log-prob on either side, or -inf on both) gets w = 0 under both modes and is counted
(``undefined_BT``, logged as ``offpolicy/is_undefined_frac``); an overflowing rho (inf) is a large ratio, capped.

With versioned tokens (docs/algorithm.md section 11, "Mixed versions") :func:`staleness_mask` keeps a token only
while the policy it trains is at most ``max_staleness`` versions past the weights that sampled it.

Dimension legend: B sequences, T token columns (response tokens under ``response_mask``). Pure torch: no
collectives, no ``.item()``, inputs never modified, no gradient through the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo_megatron.choices import OFF_POLICY_CORRECTIONS


@dataclass(frozen=True)
class ImportanceWeights:
    """The correction of one micro-batch.

    Attributes:
        weights_BT: ``[B, T]`` fp32 detached multiplier w of each token's surrogate, 0 off the response.
        ratio_BT: ``[B, T]`` fp32 detached rho = pi_prox / mu before the cap, 0 off the response and where undefined.
        capped_BT: ``[B, T]`` bool, response tokens with rho > C (truncated by ``tis``, dropped by ``mis``).
        undefined_BT: ``[B, T]`` bool, response tokens whose rho is NaN (weight 0 in both modes).
    """

    weights_BT: torch.Tensor
    ratio_BT: torch.Tensor
    capped_BT: torch.Tensor
    undefined_BT: torch.Tensor


@torch.no_grad()
def importance_weights(
    proximal_logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    mode: str,
    cap: float,
) -> ImportanceWeights:
    """Token weights of ``mode`` (``tis`` or ``mis``) with cap ``cap`` (docs/algorithm.md section 11).

    ``proximal_logprobs_BT`` (log pi_prox) and ``behaviour_logprobs_BT`` (log mu, the engine's) are ``[B, T]`` in
    nats; ``response_mask_BT`` ``[B, T]`` bool. An overflowing rho (inf) is capped to C by ``tis`` and dropped
    by ``mis``; an undefined one (NaN) is weighted 0 and flagged; padding may hold anything, even NaN.

    Raises:
        ValueError: ``mode`` not ``tis`` / ``mis``, ``cap`` <= 0 (wrong-sized caps below 1 are the caller's
            choice), shapes that differ, a non-bool mask.
    """
    if mode not in OFF_POLICY_CORRECTIONS[1:]:
        raise ValueError(f"importance_weights: mode={mode!r}; choose 'tis' or 'mis' ('none' needs no weights)")
    if not cap > 0:
        raise ValueError(f"importance_weights: cap={cap} must be > 0 (truncated/masked IS use C = 2 by default)")
    shape = tuple(response_mask_BT.shape)
    for name, tensor in (
        ("proximal_logprobs_BT", proximal_logprobs_BT),
        ("behaviour_logprobs_BT", behaviour_logprobs_BT),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must match response_mask_BT {shape}")
    if response_mask_BT.dtype != torch.bool:
        raise ValueError(f"response_mask_BT must be bool (True = response token); got {response_mask_BT.dtype}")
    zero = torch.zeros((), dtype=torch.float32, device=response_mask_BT.device)
    log_ratio_BT = proximal_logprobs_BT.detach().float() - behaviour_logprobs_BT.float()
    undefined_BT = response_mask_BT & torch.isnan(log_ratio_BT)
    defined_BT = response_mask_BT & ~undefined_BT
    ratio_BT = torch.where(defined_BT, torch.exp(torch.where(defined_BT, log_ratio_BT, zero)), zero)
    capped_BT = defined_BT & (ratio_BT > cap)
    if mode == "tis":
        weights_BT = torch.clamp(ratio_BT, max=cap)
    else:
        weights_BT = torch.where(capped_BT, zero, ratio_BT)
    return ImportanceWeights(weights_BT=weights_BT, ratio_BT=ratio_BT, capped_BT=capped_BT, undefined_BT=undefined_BT)


@dataclass(frozen=True)
class StalenessMask:
    """The per-token staleness bound of one micro-batch.

    Attributes:
        keep_BT: ``[B, T]`` bool, response tokens within the bound (the loss's mask is ``response_mask & keep``).
        lag_BT: ``[B, T]`` int64 versions between each token's sampler and the trained policy, 0 off the response.
        stale_BT: ``[B, T]`` bool, response tokens past the bound (counted, ``async/stale_token_frac``).
    """

    keep_BT: torch.Tensor
    lag_BT: torch.Tensor
    stale_BT: torch.Tensor


@torch.no_grad()
def staleness_mask(
    token_versions_BT: torch.Tensor, response_mask_BT: torch.Tensor, *, policy_version: int, max_staleness: int
) -> StalenessMask:
    """Mask the response tokens sampled more than ``max_staleness`` versions before ``policy_version``.

    ``token_versions_BT``: ``[B, T]`` int64, the completed steps of the weights that sampled each token (a weight
    update in the middle of a completion: v before it, v+1 after); ``policy_version``: the completed steps of the
    policy being trained (it trains step ``policy_version + 1``); ``response_mask_BT``: ``[B, T]`` bool.

    Raises:
        ValueError: ``max_staleness`` < 0, shapes that differ, a non-bool mask, a non-integer version tensor, or a
            response token sampled by a version after ``policy_version``.
    """
    if max_staleness < 0:
        raise ValueError(f"staleness_mask: max_staleness={max_staleness} must be >= 0 (0 keeps only on-policy tokens)")
    if tuple(token_versions_BT.shape) != tuple(response_mask_BT.shape):
        raise ValueError(
            f"token_versions_BT has shape {tuple(token_versions_BT.shape)}; it must match response_mask_BT "
            f"{tuple(response_mask_BT.shape)}"
        )
    if response_mask_BT.dtype != torch.bool or token_versions_BT.is_floating_point():
        raise ValueError("staleness_mask: response_mask_BT must be bool and token_versions_BT integer")
    lag_BT = torch.where(response_mask_BT, policy_version - token_versions_BT.long(), 0)
    if bool((lag_BT < 0).any()):
        raise ValueError(f"staleness_mask: a token was sampled by a version after the trained one ({policy_version})")
    stale_BT = response_mask_BT & (lag_BT > max_staleness)
    return StalenessMask(keep_BT=response_mask_BT & ~stale_BT, lag_BT=lag_BT, stale_BT=stale_BT)


def staleness_stats(mask: StalenessMask, response_mask_BT: torch.Tensor, *, max_staleness: int) -> dict[str, float]:
    """The version histogram of a batch's response tokens (``lag_BT`` of ``mask``).

    ``async/staleness_mean`` and ``_max`` of the lag, ``async/stale_token_frac`` and ``_tokens`` (past the bound) and
    ``async/version_frac_lag<d>``: the fraction d versions old, d = 0 .. ``max_staleness``.
    """
    lags = mask.lag_BT[response_mask_BT].double()
    num = max(lags.numel(), 1)
    stats = {
        "async/staleness_mean": float(lags.sum() / num),
        "async/staleness_max": float(lags.max()) if lags.numel() else 0.0,
        "async/stale_token_frac": float(mask.stale_BT.sum()) / num,
        "async/stale_tokens": float(mask.stale_BT.sum()),
    }
    return stats | {f"async/version_frac_lag{d}": float((lags == d).sum()) / num for d in range(max_staleness + 1)}
