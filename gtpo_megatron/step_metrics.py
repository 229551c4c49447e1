"""A training step's logged metrics, assembled from its parts (``Trainer.step`` hands them over, no collective).

Names: ``rollout/*``, ``reward/*`` (``rollout.batch.rollout_metrics``), the conflict and objective metrics
(``algorithm``), the policy's own as ``train/*`` (``perf/*`` and ``mismatch/*`` kept), ``time/*`` and throughput.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from gtpo_megatron.algorithm import StepWeights, conflict_metrics, objective_metrics
from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.rollout.batch import rollout_metrics

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig
    from gtpo_megatron.ops import LossSpec
    from gtpo_megatron.rollout.collector import StepRollout

logger = logging.getLogger(__name__)


def step_metrics(
    rollout: StepRollout,
    batch: TrainBatch,
    weights: StepWeights,
    train_metrics: dict[str, float],
    measured: dict[str, float],
    *,
    initial_entropy: float | None,
    with_reference: bool,
) -> dict[str, float]:
    """Rollout, conflict and objective metrics, the policy's, ``measured`` (``time/step_s`` included), throughput.

    ``batch``: the step's whole ``[B, S]`` batch; ``initial_entropy``: <H>_ini once known; ``with_reference``: a KL
    reference ran (``time/ref_logprob_s`` defaults to 0 then, as ``time/old_logprob_s`` always).
    """
    metrics = rollout_metrics(
        batch, torch.tensor(rollout.scores), torch.tensor(rollout.correct), torch.tensor(rollout.format_ok)
    )
    metrics.update(conflict_metrics(weights, batch.response_mask))
    metrics.update(objective_metrics(train_metrics))
    if initial_entropy is not None:
        metrics["entropy/initial"] = initial_entropy
    metrics.update({k if k.startswith(("perf/", "mismatch/")) else f"train/{k}": v for k, v in train_metrics.items()})
    metrics.update({"time/old_logprob_s": 0.0, **({"time/ref_logprob_s": 0.0} if with_reference else {})})
    metrics.update({**rollout.stats, **measured})
    metrics["perf/tokens_per_s"] = float(batch.token_mask.sum()) / metrics["time/step_s"]
    metrics["perf/response_tokens_per_s"] = float(batch.response_mask.sum()) / metrics["time/step_s"]
    return metrics


def measures_mismatch(loss_spec: LossSpec, cfg: GTPOConfig) -> bool:
    """Whether ``mismatch/*`` compare like with like: the loss log-probs at the sampling temperature (else warns)."""
    if loss_spec.temperature == cfg.rollout.temperature:
        return True
    logger.warning(
        "algorithm.loss_temperature=%s: the loss log-probs are at T=%s while vLLM's are at the sampling "
        "temperature %s, so mismatch/* are not reported",
        cfg.algorithm.loss_temperature,
        loss_spec.temperature,
        cfg.rollout.temperature,
    )
    return False
