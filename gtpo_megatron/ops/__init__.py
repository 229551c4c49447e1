"""Pure GTPO math on tensors (docs/algorithm.md sections 1-4): torch only, explicit process groups, no side effects."""

from __future__ import annotations

from gtpo_megatron.ops.advantages import (
    ADVANTAGE_ESTIMATOR_REGISTRY,
    compute_group_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from gtpo_megatron.ops.conflicts import CONFLICT_MODES, OVERLAP_MODES, build_conflict_weights, conflict_normalizers
from gtpo_megatron.ops.entropy_filter import (
    ENTROPY_FILTER_MODES,
    LN2,
    apply_entropy_penalty,
    entropy_keep_mask,
    sequence_mean_entropy,
)
from gtpo_megatron.ops.logprobs import vocab_parallel_logprobs_entropy
from gtpo_megatron.ops.loss_metrics import MEANS, means, mismatch_sums, policy_loss_metrics
from gtpo_megatron.ops.losses import AGGREGATIONS, KL_ESTIMATORS, LOSS_NAMES, LossSpec, compute_normalizer, policy_loss
from gtpo_megatron.ops.objective import SequenceTerms, policy_objective, sequence_terms
from gtpo_megatron.ops.off_policy import (
    OFF_POLICY_CORRECTIONS,
    ImportanceWeights,
    StalenessMask,
    importance_weights,
    staleness_mask,
    staleness_stats,
)
from gtpo_megatron.ops.packing import PackedLayout

__all__ = [
    "ADVANTAGE_ESTIMATOR_REGISTRY",
    "AGGREGATIONS",
    "CONFLICT_MODES",
    "ENTROPY_FILTER_MODES",
    "KL_ESTIMATORS",
    "LN2",
    "LOSS_NAMES",
    "MEANS",
    "OFF_POLICY_CORRECTIONS",
    "ImportanceWeights",
    "LossSpec",
    "OVERLAP_MODES",
    "PackedLayout",
    "SequenceTerms",
    "apply_entropy_penalty",
    "build_conflict_weights",
    "compute_group_advantages",
    "compute_normalizer",
    "conflict_normalizers",
    "entropy_keep_mask",
    "get_advantage_estimator",
    "importance_weights",
    "staleness_mask",
    "staleness_stats",
    "StalenessMask",
    "means",
    "mismatch_sums",
    "policy_loss",
    "policy_loss_metrics",
    "policy_objective",
    "register_advantage_estimator",
    "sequence_mean_entropy",
    "sequence_terms",
    "vocab_parallel_logprobs_entropy",
]
