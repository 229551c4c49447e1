"""Build the real components of a run from its config: policy, rollout engine, reward pool, data, sink.

Each component receives its config section. Global rank 0 also owns the vLLM engine (multiprocess: the in-process
engine hangs inside a multi-rank job, ``../shared/FEASIBILITY.md`` section 2), the reward pool and the prompt
loader; the other ranks get the step's completions by broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch

from gtpo_megatron import run_dir
from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.config import GTPOConfig, config_to_dict
from gtpo_megatron.logging import MetricSink
from gtpo_megatron.trainer import Trainer

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.megatron_adapter.reference import FrozenReference
    from gtpo_megatron.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


def build_policy(
    cfg: GTPOConfig, model_path: str, groups: ParallelGroups, *, padding_tp_size: int | None = None
) -> MegatronPolicy:
    """``MegatronPolicy`` of the model at ``model_path`` with the run's ``PolicySettings``.

    ``megatron_adapter.settings.policy_settings`` derives them from the model, parallel and optim sections.

    ``padding_tp_size``: build with the vocabulary/head padding of a run at that TP size (to load its checkpoint
    at another layout; see ``MegatronPolicy.from_pretrained``).
    """
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

    return MegatronPolicy.from_pretrained(
        _policy_settings(cfg, model_path), groups=groups, padding_tp_size=padding_tp_size
    )


def _policy_settings(cfg: GTPOConfig, model_path: str):
    """``policy_settings(cfg)`` with the model weights at ``model_path`` (a resolved folder)."""
    from gtpo_megatron.megatron_adapter.settings import policy_settings

    return policy_settings(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=model_path)))


def build_reference(cfg: GTPOConfig, model_path: str, groups: ParallelGroups) -> FrozenReference | None:
    """The frozen reference policy of the KL term when ``algorithm.kl_coef > 0``, else None.

    The initial weights at ``model_path`` under the policy's model section and layout (GTPO_SPEC section 5).
    """
    if cfg.algorithm.kl_coef == 0:
        return None
    from gtpo_megatron.megatron_adapter.reference import FrozenReference

    return FrozenReference.from_pretrained(
        _policy_settings(cfg, model_path), groups=groups, offload=cfg.algorithm.kl_reference_offload
    )


def build_collector(cfg: GTPOConfig, model_path: str, tokenizer):
    """Rank 0's ``RolloutCollector``: vLLM engine, reward pool and a loader over the prompts that fit."""
    from gtpo_megatron.data.datasets import load_problems
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.data.prompts import SYSTEM_PROMPTS, build_prompt_ids
    from gtpo_megatron.rewards import RewardPool, default_extraction
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    data, rollout = cfg.data, cfg.rollout
    extra = {"seed": data.shuffle_seed, "difficulty": data.synthetic_difficulty} if data.source == "synthetic" else {}
    problems = load_problems(data.source, path=data.path, split=data.split, limit=data.limit, **extra)
    system_prompt = SYSTEM_PROMPTS[data.system_prompt]
    fitting = [
        p
        for p in problems
        if len(build_prompt_ids(tokenizer, p.question, system_prompt=system_prompt)) <= rollout.max_prompt_len
    ]
    if len(fitting) < len(problems):
        logger.warning(
            "skipped %d of %d problems longer than rollout.max_prompt_len=%d tokens",
            len(problems) - len(fitting),
            len(problems),
            rollout.max_prompt_len,
        )
    loader = PromptLoader(fitting, batch_size=rollout.num_prompts, seed=data.shuffle_seed, shuffle=True)
    engine = VLLMEngine(
        model_path,
        dtype=cfg.model.params_dtype if rollout.dtype == "auto" else rollout.dtype,
        max_model_len=rollout.max_prompt_len + rollout.max_tokens,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        cpu_kvcache_space_gib=max(1, math.ceil(rollout.cpu_kv_cache_gib)),
        tensor_parallel_size=rollout.engine_tp_size,
        seed=rollout.seed,
        enable_sleep_mode=rollout.placement == "colocated" and torch.cuda.is_available(),
        max_num_seqs=max(16, rollout.num_prompts * cfg.algorithm.group_size),
        # Started from a Megatron checkpoint: the HF folder may hold no weights; the trainer pushes the policy's.
        load_format="dummy" if cfg.model.megatron_checkpoint is not None else "auto",
    )
    pool = RewardPool(cfg.reward.name, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    return RolloutCollector(
        engine=engine,
        reward_pool=pool,
        tokenizer=tokenizer,
        loader=loader,
        rollout_cfg=rollout,
        algorithm_cfg=cfg.algorithm,
        reward_cfg=cfg.reward,
        extraction=cfg.reward.extraction or default_extraction(data.source),
        system_prompt=system_prompt,
    )


def build_trainer(cfg: GTPOConfig, groups: ParallelGroups) -> Trainer:
    """All components of a run on this rank; ``groups`` from ``parallel.groups.init_distributed``."""
    from transformers import AutoTokenizer

    model_path = resolve_model_path(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = build_policy(cfg, model_path, groups)
    collector = build_collector(cfg, model_path, tokenizer) if groups.rank == 0 else None
    checkpoints = run_dir.list_checkpoints(run_dir.checkpoints_dir(cfg.output_dir)) if cfg.resume else []
    start_step = run_dir.checkpoint_step(checkpoints[-1]) if checkpoints else 0
    sink = MetricSink(
        cfg.output_dir,
        cfg=cfg.logging,
        run_config=config_to_dict(cfg),
        max_steps=cfg.trainer.max_steps,
        start_step=start_step,
        enabled=groups.rank == 0,
    )
    return Trainer(
        cfg,
        groups=groups,
        policy=policy,
        collector=collector,
        pad_token_id=pad_token_id,
        sink=sink,
        reference=build_reference(cfg, model_path, groups),
    )
