"""Build the real components of a run from its config: policy, rollout engine, reward pool, data, sink.

Each component receives its config section. Global rank 0 also owns the vLLM engine (multiprocess: the in-process
engine hangs inside a multi-rank job, ``../shared/FEASIBILITY.md`` section 2), the reward pool and the prompt
loader; the other ranks get the step's completions by broadcast.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch

from gtpo_megatron import run_dir
from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.config import GTPOConfig, config_to_dict
from gtpo_megatron.logging import MetricSink
from gtpo_megatron.trainer import PhaseTimer, Trainer

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
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
    from gtpo_megatron.megatron_adapter.settings import policy_settings

    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=model_path))
    return MegatronPolicy.from_pretrained(policy_settings(cfg), groups=groups, padding_tp_size=padding_tp_size)


def build_collector(cfg: GTPOConfig, model_path: str, tokenizer):
    """Rank 0's ``RolloutCollector``: vLLM engine, reward pool and a loader over the prompts that fit."""
    from gtpo_megatron.data.datasets import load_problems
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.data.prompts import build_prompt_ids
    from gtpo_megatron.rewards import RewardPool, default_extraction
    from gtpo_megatron.rollout.collector import RolloutCollector
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    data, rollout = cfg.data, cfg.rollout
    extra = {"seed": data.shuffle_seed, "difficulty": data.synthetic_difficulty} if data.source == "synthetic" else {}
    problems = load_problems(data.source, path=data.path, split=data.split, limit=data.limit, **extra)
    fitting = [p for p in problems if len(build_prompt_ids(tokenizer, p.question)) <= rollout.max_prompt_len]
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
        verbose=cfg.logging.verbose,
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
    )


def build_trainer(cfg: GTPOConfig, groups: ParallelGroups, *, timer: PhaseTimer | None = None) -> Trainer:
    """All components of a run on this rank; ``groups`` from ``parallel.groups.init_distributed``.

    Global rank 0 builds its rollout side (prompts, vLLM engine, reward pool: ``build_collector``) in a background
    thread while the policy loads and the metric sink starts: the engine's start is mostly its own processes
    starting, so it overlaps the model build instead of following it. ``timer`` records the start-up phases
    (``time/startup/<phase>_s``).
    """
    from transformers import AutoTokenizer

    timer = timer or PhaseTimer()
    with timer.phase("startup/tokenizer"):
        model_path = resolve_model_path(cfg.model.name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rollout_side = None
    if groups.rank == 0:
        rollout_side = _in_background(timer, "startup/rollout_side", build_collector, cfg, model_path, tokenizer)
    sink = None
    try:
        with timer.phase("startup/policy"):
            policy = build_policy(cfg, model_path, groups)
        with timer.phase("startup/metric_sink"):
            sink = _build_sink(cfg, groups)
        with timer.phase("startup/rollout_side_wait"):
            collector = rollout_side.result() if rollout_side is not None else None
    except BaseException:
        _discard(rollout_side, sink)
        raise
    return Trainer(cfg, groups=groups, policy=policy, collector=collector, pad_token_id=pad_token_id, sink=sink)


def _build_sink(cfg: GTPOConfig, groups: ParallelGroups) -> MetricSink:
    """The metric sink (enabled on rank 0), continuing the newest complete checkpoint's metrics on resume."""
    checkpoints = run_dir.list_checkpoints(run_dir.checkpoints_dir(cfg.output_dir)) if cfg.resume else []
    return MetricSink(
        cfg.output_dir,
        cfg=cfg.logging,
        run_config=config_to_dict(cfg),
        max_steps=cfg.trainer.max_steps,
        start_step=run_dir.checkpoint_step(checkpoints[-1]) if checkpoints else 0,
        enabled=groups.rank == 0,
    )


def _in_background(timer: PhaseTimer, phase: str, fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` started in a thread of its own, timed as ``phase``; ``future.result()`` returns or raises.

    Submitted to a one-worker pool that is shut down at once, so no other job can queue behind it.
    """

    def timed():
        with timer.phase(phase):
            return fn(*args)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gtpo-build")
    future = pool.submit(timed)
    pool.shutdown(wait=False)
    return future


def _discard(rollout_side: concurrent.futures.Future | None, sink: MetricSink | None) -> None:
    """After a failed build: close the sink and the rollout side, once that is built (it cannot be interrupted)."""
    if sink is not None:
        sink.close()
    if rollout_side is None or rollout_side.exception() is not None:
        return
    collector = rollout_side.result()
    collector.engine.close()
    collector.reward_pool.close()
