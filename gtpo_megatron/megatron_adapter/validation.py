"""The job's first check: ``GTPOConfig.validate`` with the model's ``config.json``, then what only this edge knows.

``validate_config`` runs in ``gtpo-train`` and ``gtpo-plan`` before any process group, engine or model exists: the
config's own rules, the model's load-time refusals (``model.check_hf_model``) on a local ``config.json``, Megatron's
field names for ``model.megatron_overrides`` and the registries' names; it warns of :func:`routing_replay_caveat`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import TYPE_CHECKING

from gtpo_megatron.builtin_models import local_model_folder
from gtpo_megatron.config.checks import require
from gtpo_megatron.megatron_adapter.settings import policy_settings

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig

logger = logging.getLogger(__name__)


def read_hf_config(name_or_path: str) -> dict | None:
    """The model's ``config.json`` as a dict when it is on local disk (built-ins: once materialised), else None."""
    path = local_model_folder(name_or_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def validate_config(cfg: GTPOConfig, world_size: int, *, check_registries: bool = True) -> None:
    """``cfg.validate(world_size)`` with the local model's ``config.json``, then Megatron's and the registries' names.

    ``check_registries`` imports torch, megatron and the rewards, and runs the model's load-time refusals
    (``model.check_hf_model``: HF fields Megatron cannot build, packing with sliding windows) on a local model.

    Raises:
        ValueError: naming the fields, the values, the rule and a fix.
    """
    hf = read_hf_config(cfg.model.name_or_path)
    cfg.validate(world_size, hf_config=hf)
    caveat = routing_replay_caveat(cfg)
    if caveat is not None:
        logger.warning(caveat)
    if not check_registries:
        return
    if hf is not None:
        from transformers import AutoConfig

        from gtpo_megatron.megatron_adapter.model import check_hf_model

        check_hf_model(AutoConfig.from_pretrained(local_model_folder(cfg.model.name_or_path)), policy_settings(cfg))
    from megatron.core.transformer import TransformerConfig

    from gtpo_megatron.ops import advantages
    from gtpo_megatron.rewards import registry

    known = {f.name for f in fields(TransformerConfig)}
    for key in cfg.model.megatron_overrides:
        require(
            key in known,
            "model.megatron_overrides",
            key,
            "is not a field of megatron TransformerConfig",
            f"use one of its fields, e.g. {sorted(known)[:5]}",
        )
    advantages.get_advantage_estimator(cfg.algorithm.advantage_estimator)
    registry.get_reward(cfg.reward.name)


def routing_replay_caveat(cfg: GTPOConfig) -> str | None:
    """The warning of routing replay with async rollouts and a TIS/MIS correction (docs/moe.md); None otherwise."""
    correction = cfg.algorithm.off_policy_correction
    if cfg.rollout.routing_replay == "off" or cfg.rollout.mode != "async" or correction == "none":
        return None
    return (
        f"rollout.routing_replay={cfg.rollout.routing_replay!r} with rollout.mode='async' and "
        f"algorithm.off_policy_correction={correction!r}: the training forward replays the experts the engine chose "
        f"with weights up to rollout.max_staleness={cfg.rollout.max_staleness} steps old, so pi_prox and mu share "
        "that routing and the importance weight pi_prox / mu cannot see how the current router would route "
        "differently (routing drift); the update trains under the stale routing. Use rollout.mode=sync or "
        "rollout.routing_replay=off where routing drift matters (docs/moe.md, routing replay with async rollouts)"
    )
