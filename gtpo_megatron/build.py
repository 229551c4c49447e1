"""Build the real components of a run from its config: policy, KL reference, data, exchange, sink, and the trainer.

Each component receives its config section. Every rank builds the same prompt loader and gets the step's completions
from the rollout exchange; the engine side (placements, engines, reward pools, weight sync, fault tolerance) is
``build_rollout``'s, and ``build_trainer`` wires both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron import run_dir
from gtpo_megatron.build_rollout import (
    bind_training_rank,
    build_collector,
    build_engine,
    build_fault_tolerance,
    build_placements,
    build_weight_sync,
    engine_environment,
)
from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.config import GTPOConfig, config_to_dict
from gtpo_megatron.config.weight_sync import run_weight_sync, with_weight_sync
from gtpo_megatron.logging import MetricSink, PhaseTimer
from gtpo_megatron.trainer import Trainer

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.policy import ReferencePolicy
    from gtpo_megatron.rollout.exchange import StepExchange

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


def build_reference(
    cfg: GTPOConfig, model_path: str, groups: ParallelGroups, policy: MegatronPolicy
) -> ReferencePolicy | None:
    """The frozen reference policy of the KL term when ``algorithm.kl_coef > 0``, else None.

    The initial weights at ``model_path`` under the policy's model section and layout (docs/algorithm.md section 5);
    with ``model.lora`` the ``policy``'s base, its adapters off.
    """
    if cfg.algorithm.kl_coef == 0:
        return None
    from gtpo_megatron.megatron_adapter.reference import AdaptersOffReference, FrozenReference

    if cfg.model.lora.enabled:
        return AdaptersOffReference(policy)

    return FrozenReference.from_pretrained(
        _policy_settings(cfg, model_path), groups=groups, offload=cfg.algorithm.kl_reference_offload
    )


def build_loader(cfg: GTPOConfig, tokenizer):
    """The prompt loader over the problems whose prompts fit ``rollout.max_prompt_len``.

    Every rank builds the same one, so every engine leader draws the same prompts and every rank holds the same
    position for checkpoints.
    """
    from gtpo_megatron.data.datasets import load_problems
    from gtpo_megatron.data.loader import PromptLoader
    from gtpo_megatron.data.prompts import SYSTEM_PROMPTS, build_prompt_ids

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
    return PromptLoader(fitting, batch_size=rollout.num_prompts, seed=data.shuffle_seed, shuffle=True)


def build_exchange(cfg: GTPOConfig, model_path: str, *, num_engines: int) -> StepExchange:
    """The step exchange of this job on the world group (the same on every rank).

    With ``rollout.routing_replay: rollout`` it carries the routed experts' layout of the MoE model at
    ``model_path``: every layer, its top-k of ``num_experts`` (a dense model gets none: the policy refuses it).
    """
    from gtpo_megatron.plan.model_families import moe_sizes
    from gtpo_megatron.rollout.exchange import RoutingLayout, StepExchange

    routing = None
    if cfg.rollout.routing_replay == "rollout":
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        if sizes := moe_sizes(hf_config.to_dict()):
            routing = RoutingLayout(hf_config.num_hidden_layers, top_k=sizes["top_k"], num_experts=sizes["num_experts"])
    return StepExchange.from_config(cfg, num_engines=num_engines, group=dist.group.WORLD, routing=routing)


def build_trainer(cfg: GTPOConfig, groups: ParallelGroups, *, timer: PhaseTimer | None = None) -> Trainer:
    """All components of a run on this rank; ``groups`` from ``parallel.groups.init_distributed``.

    Every engine leader builds its rollout side (vLLM engine, reward pool: ``build_collector``) in a background
    thread while the policy (and the KL reference) load and the metric sink starts: the engine's start is mostly its
    own processes starting, so it overlaps the model build instead of following it. The engine's environment
    variables (its devices or CPU cores) are set while it starts; CUDA is initialised by ``init_distributed`` before,
    so the policy's devices do not change. With separate engines on CPU the rank is bound to its own cores first
    and the rollout side's thread to its engine's (``bind_training_rank``). Then every rank joins the weight sync
    (its path resolved first, logged once: ``config/weight_sync.py``; every component and wandb's run config see
    the resolved one). ``timer`` records the start-up phases (``time/startup/<phase>_s``).
    """
    from transformers import AutoTokenizer

    timer = timer or PhaseTimer()
    sync_choice = run_weight_sync(cfg, accelerator=torch.cuda.is_available())
    cfg = with_weight_sync(cfg, sync_choice)
    adapters = cfg.model.lora.enabled and cfg.rollout.lora_sync == "adapter"  # no weight_sync path then
    if groups.rank == 0:
        logger.info("weight sync: %s", "rollout.lora_sync=adapter" if adapters else sync_choice.describe())
    with timer.phase("startup/tokenizer"):
        model_path = resolve_model_path(cfg.model.name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    placements = build_placements(cfg, groups.world_size)
    mine = next((p for p in placements if p.leader_rank == groups.rank), None)
    exchange = build_exchange(cfg, model_path, num_engines=len(placements))
    rollout_side, environment = None, None
    if mine is not None:
        environment = engine_environment(mine, placements, cfg, groups.world_size)  # before the rank's binding
    bound = bind_training_rank(cfg, placements, groups.rank, groups.world_size)
    if mine is not None:
        engine_cores = None if bound is None else bound[1]
        rollout_side = _in_background(
            timer, "startup/rollout_side", build_collector, cfg, model_path, tokenizer, mine, environment, exchange,
            engine_cores, cores=engine_cores,
        )  # fmt: skip
    sink = None
    try:
        with timer.phase("startup/policy"):
            policy = build_policy(cfg, model_path, groups)
            reference = build_reference(cfg, model_path, groups, policy)
        with timer.phase("startup/metric_sink"):
            sink = _build_sink(cfg, groups)
        with timer.phase("startup/rollout_side_wait"):
            collector = rollout_side.result() if rollout_side is not None else None
        with timer.phase("startup/weight_sync"):
            engine = collector.engine if collector is not None else None
            weight_sync = build_weight_sync(cfg, groups, engine, placements, policy)
        fault_tolerance = None
        if cfg.rollout.fault_tolerance:
            restart = None if mine is None else functools.partial(build_engine, cfg, model_path, mine, environment)
            fault_tolerance = build_fault_tolerance(cfg, groups, collector, placements, weight_sync, restart, policy)
    except BaseException:
        _discard(rollout_side, sink)
        raise
    return Trainer(
        cfg,
        groups=groups,
        policy=policy,
        collector=collector,
        loader=build_loader(cfg, tokenizer),
        exchange=exchange,
        pad_token_id=pad_token_id,
        sink=sink,
        reference=reference,
        weight_sync=fault_tolerance or weight_sync,  # the recovery syncs the live engines and admits restarted ones
        fault_tolerance=fault_tolerance,
    )


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


def _in_background(timer: PhaseTimer, phase: str, fn, *args, cores=None) -> concurrent.futures.Future:
    """``fn(*args)`` started in a thread of its own, timed as ``phase``; ``future.result()`` returns or raises.

    Submitted to a one-worker pool that is shut down at once, so no other job can queue behind it. ``cores``: the
    thread runs on these CPU cores (the processes it starts inherit them), else on the rank's.
    """

    def timed():
        if cores is not None:
            os.sched_setaffinity(0, cores)  # this thread only
        with timer.phase(phase):
            return fn(*args)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gtpo-build")
    future = pool.submit(timed)
    pool.shutdown(wait=False)
    return future


def _discard(rollout_side: concurrent.futures.Future | None, sink: MetricSink | None) -> None:
    """After a failed build: close the sink and the rollout side, once that is built (it cannot be interrupted)."""
    from gtpo_megatron.rollout.engine_guard import close_all

    steps = [("the metric sink", sink.close)] if sink is not None else []
    if rollout_side is not None and rollout_side.exception() is None:
        collector = rollout_side.result()
        steps += [("the rollout engine", collector.engine.close), ("the reward pool", collector.reward_pool.close)]
    close_all(steps)
