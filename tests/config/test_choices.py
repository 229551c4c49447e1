"""Each closed choice of the config is the list the code that runs it accepts, and the off-policy cap has one floor.

The algorithm's choices are ``choices`` types the config annotates with; the choices owned above the config (its
loader imports no torch, data or rewards) are compared here with their owners.
"""

from __future__ import annotations

import dataclasses
from typing import get_args, get_type_hints

import pytest

from gtpo_megatron import choices
from gtpo_megatron.config import AlgorithmConfig, DataConfig, ModelConfig, RewardConfig, RolloutConfig
from gtpo_megatron.data.prompts import SYSTEM_PROMPTS
from gtpo_megatron.data.synthetic import SYNTHETIC_LEVELS
from gtpo_megatron.megatron_adapter.model import _DTYPES as TRAIN_DTYPES
from gtpo_megatron.ops import LossSpec
from gtpo_megatron.plan.memory import Recompute
from gtpo_megatron.rewards import EXTRACTION_MODES
from gtpo_megatron.rollout.engine_settings import ENGINE_DTYPES

OWNERS = [
    (AlgorithmConfig, "name", choices.LOSS_NAMES),
    (AlgorithmConfig, "aggregation", choices.AGGREGATIONS),
    (AlgorithmConfig, "kl_estimator", choices.KL_ESTIMATORS),
    (AlgorithmConfig, "entropy_filter", choices.ENTROPY_FILTER_MODES),
    (AlgorithmConfig, "conflict_mode", (*choices.CONFLICT_MODES, "off")),
    (AlgorithmConfig, "conflict_overlap", choices.OVERLAP_MODES),
    (AlgorithmConfig, "off_policy_correction", choices.OFF_POLICY_CORRECTIONS),
    (ModelConfig, "recompute", get_args(Recompute)),
    (ModelConfig, "params_dtype", tuple(TRAIN_DTYPES)),
    (RolloutConfig, "dtype", ENGINE_DTYPES),
    (DataConfig, "synthetic_difficulty", tuple(SYNTHETIC_LEVELS)),
    (DataConfig, "system_prompt", tuple(SYSTEM_PROMPTS)),
    (RewardConfig, "extraction", (*EXTRACTION_MODES, None)),
]


def _literal_values(hint) -> set:
    """The values a ``Literal`` (or ``Literal | None``) annotation admits."""
    values = set()
    for arg in get_args(hint):
        values |= _literal_values(arg) if get_args(arg) else {None if arg is type(None) else arg}
    return values


@pytest.mark.parametrize(("section", "name", "owner"), OWNERS, ids=[f"{s.__name__}.{n}" for s, n, _ in OWNERS])
def test_each_config_choice_is_its_owners_list(section, name, owner):
    assert _literal_values(get_type_hints(section)[name]) == set(owner)


def test_the_algorithm_rules_between_choices_name_known_losses():
    assert set(choices.REQUIRED_AGGREGATION) | set(choices.KL_LOSSES) <= set(choices.LOSS_NAMES)
    assert set(choices.REQUIRED_AGGREGATION.values()) <= set(choices.AGGREGATIONS)


def test_the_config_and_the_loss_share_the_off_policy_cap_floor():
    spec = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
    floor = choices.OFF_POLICY_CAP_MIN
    assert floor == 1.0  # an on-policy token's ratio is exactly 1: a lower cap would clip it
    dataclasses.replace(spec, off_policy_correction="tis", off_policy_cap=floor)
    AlgorithmConfig(off_policy_correction="tis", off_policy_cap=floor)
    for cap in (0.999, 0.5, 0.0):
        with pytest.raises(ValueError, match=f"off_policy_cap={cap}.*must be >= 1.0"):
            dataclasses.replace(spec, off_policy_correction="tis", off_policy_cap=cap)
        with pytest.raises(ValueError, match=f"algorithm.off_policy_cap={cap}: must be >= 1.0"):
            AlgorithmConfig(off_policy_cap=cap)
