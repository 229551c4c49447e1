"""How a vLLM engine starts: ``EngineSettings``, built once from the config (torch- and vLLM-free).

``engine_settings(cfg)`` is the one reader of the config for the training engines (``build_rollout.py``); ``gtpo-eval``
builds its engine's from its own flags (``evaluation/evaluate.py``). ``rollout/vllm_engine.py:VLLMEngine`` starts
from one record. A new engine setting (a LoRA adapter, an FP8 weight or KV-cache dtype) is a field here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig

ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Weight dtypes an engine starts in (``auto``: the checkpoint's); pushed weights are cast to it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """One engine's vLLM settings (the fields as ``VLLMEngine`` and vLLM name them).

    ``max_model_len``: prompt + completion tokens; ``cpu_kvcache_space_gib``: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB);
    ``in_process``: the engine core in this process (None: the environment's); ``staging_dir``: default
    ``node_local.staging_root``; ``load_format``: ``auto`` or ``dummy`` (random until the first weight update);
    ``routing_replay``: completions carry their routed experts (docs/moe.md); ``max_lora_rank``: serve a LoRA
    adapter of at most this rank (``rollout/vllm_lora.py``; None: no LoRA).

    Raises:
        ValueError: unknown ``dtype`` or ``load_format``, or ``cpu_kvcache_space_gib <= 0``.
    """

    dtype: str = "float32"
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_space_gib: float = 1.0
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    max_num_seqs: int = 64
    in_process: bool | None = None
    staging_dir: str | None = None
    verbose: bool = False
    load_format: str = "auto"
    routing_replay: bool = False
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {list(ENGINE_DTYPES)}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not supported; choose 'auto' or 'dummy'")
        if self.cpu_kvcache_space_gib <= 0:
            raise ValueError(f"cpu_kvcache_space_gib={self.cpu_kvcache_space_gib} must be > 0 GiB; use 1")


def engine_settings(cfg: GTPOConfig, *, accelerator: bool) -> EngineSettings:
    """The training engines' settings: ``GTPOConfig.engine_dtype``, the ``rollout`` section, ``logging.verbose``.

    ``accelerator``: CUDA is available (a colocated engine then sleeps while the policy trains). Started from a
    Megatron checkpoint (``model.megatron_checkpoint``) the HF folder may hold no weights: ``load_format=dummy``,
    the trainer pushes the policy's.
    """
    rollout = cfg.rollout
    return EngineSettings(
        dtype=cfg.engine_dtype,
        max_model_len=rollout.max_prompt_len + rollout.max_tokens,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        cpu_kvcache_space_gib=max(1, math.ceil(rollout.cpu_kv_cache_gib)),
        tensor_parallel_size=rollout.engine_tp_size,
        seed=rollout.seed,
        enable_sleep_mode=rollout.placement == "colocated" and accelerator,
        max_num_seqs=max(16, rollout.num_prompts * cfg.algorithm.group_size * _batches_at_once(rollout)),
        verbose=cfg.logging.verbose,
        load_format="dummy" if cfg.model.megatron_checkpoint is not None else "auto",
        routing_replay=rollout.routing_replay == "rollout",
        max_lora_rank=cfg.model.lora.rank if rollout.lora_sync == "adapter" else None,
    )


def _batches_at_once(rollout) -> int:
    """Batches an engine holds at once: every queued one (1 + ``max_staleness``) with partial rollouts, else 1."""
    return 1 + rollout.max_staleness if rollout.partial_rollouts else 1
