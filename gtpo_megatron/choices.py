"""The algorithm's closed choices and the rules between them: one owner for the config and the ops.

The config annotates its fields with these ``Literal`` types (its loader checks a value against them) and the ops
dispatch on the derived tuples, so a new option (an off-policy correction, a KL estimator) is named here once.
Stdlib only: the config imports no torch, the ops import nothing above them.
"""

from __future__ import annotations

from typing import Literal, get_args

LossName = Literal["gtpo", "grpo", "dapo", "dr_grpo"]
Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]
KlEstimator = Literal["k1", "k2", "k3"]
EntropyFilterMode = Literal["off", "paper", "fixed"]
ConflictMode = Literal["prefix_suffix", "any_position"]
ConflictOverlap = Literal["once", "multiply"]
OffPolicyCorrection = Literal["none", "tis", "mis"]

LOSS_NAMES: tuple[str, ...] = get_args(LossName)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
ENTROPY_FILTER_MODES: tuple[str, ...] = get_args(EntropyFilterMode)
CONFLICT_MODES: tuple[str, ...] = get_args(ConflictMode)
OVERLAP_MODES: tuple[str, ...] = get_args(ConflictOverlap)
OFF_POLICY_CORRECTIONS: tuple[str, ...] = get_args(OffPolicyCorrection)

REQUIRED_AGGREGATION = {"dapo": "token-mean", "dr_grpo": "seq-mean-token-sum"}
"""The losses defined with one aggregation (docs/algorithm.md section 5); the others take any."""
KL_LOSSES = ("grpo", "dr_grpo")
"""The losses with a KL term to a reference policy (docs/algorithm.md sections 1 and 5)."""
OFF_POLICY_CAP_MIN = 1.0
"""The least cap C of an off-policy correction (docs/algorithm.md section 11): a cap below 1 would truncate
(``tis``) or mask (``mis``) the tokens whose ratio is exactly 1, those the engine and the trainer agree on."""
