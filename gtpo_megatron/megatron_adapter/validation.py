"""The job's first check: ``GTPOConfig.validate`` with the model's ``config.json``, then what only this edge knows.

``validate_config`` runs in ``gtpo-train`` and ``gtpo-plan`` before any process group, engine or model exists: the
config's own rules, the model's load-time refusals (``model.check_hf_model``) on a local ``config.json``, Megatron's
field names for ``model.megatron_overrides`` and the registries' names.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import TYPE_CHECKING

from gtpo_megatron.builtin_models import local_model_folder
from gtpo_megatron.config.checks import require
from gtpo_megatron.megatron_adapter.settings import policy_settings

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig


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
