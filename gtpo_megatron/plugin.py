"""GTPO for an existing Megatron pipeline: step weights, the loss in Megatron's conventions, a forward step, sync.

The trainer's own code behind a small public surface (re-exported from the package root; docs/plugin.md is the
guide). Importing it imports neither megatron nor vllm. Compute the weights on whole groups, before splitting the
batch over DP ranks (docs/algorithm.md section 8); rows with ``loss_row_mask`` False leave the loss and its
normaliser. Conventions: B rows group by group, per-token tensors in ``TrainBatch`` columns (Megatron-LM's
``[B, S-1]``: ``F.pad(x, (1, 0))``), bool masks (docs/architecture.md, "Mask vocabulary"), nats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from gtpo_megatron.algorithm import StepWeights, build_loss_spec, compute_weights, with_entropy_terms
from gtpo_megatron.config import AlgorithmConfig, LoRAConfig, RolloutConfig
from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode, install_cpu_compat
from gtpo_megatron.megatron_adapter.external_model import model_geometry, unwrap_model
from gtpo_megatron.megatron_adapter.forward_step import ForwardSettings, MicroBatch, token_logprobs_entropy
from gtpo_megatron.megatron_adapter.hf_stream import iter_hf_weights
from gtpo_megatron.megatron_adapter.loss_forms import (
    forward_settings,
    legacy_loss,
    legacy_loss_from_logprobs,
    make_forward_step,
    per_token_loss,
    per_token_loss_from_logprobs,
    reduce_loss_metrics,
)
from gtpo_megatron.ops import LossSpec, PackedLayout, compute_normalizer, sequence_mean_entropy
from gtpo_megatron.parallel.collectives import global_normalizer
from gtpo_megatron.parallel.groups import ParallelGroups, current_groups, init_distributed
from gtpo_megatron.rollout.engine import RolloutEngine
from gtpo_megatron.rollout.push import DEFAULT_BUCKET_BYTES, PushStats, push_weights

__all__ = [
    "AlgorithmConfig",
    "ForwardSettings",
    "LoRAConfig",
    "LossSpec",
    "MicroBatch",
    "PackedLayout",
    "ParallelGroups",
    "PushStats",
    "RolloutConfig",
    "StepWeights",
    "attach_lora",
    "build_loss_spec",
    "compute_gtpo_weights",
    "cuda_to_cpu_mode",
    "current_groups",
    "forward_settings",
    "init_distributed",
    "install_cpu_compat",
    "legacy_loss",
    "legacy_loss_from_logprobs",
    "loss_normalizer",
    "make_forward_step",
    "per_token_loss",
    "per_token_loss_from_logprobs",
    "reduce_loss_metrics",
    "save_adapters",
    "sequence_mean_entropy",
    "sync_weights",
    "token_logprobs_entropy",
]


def compute_gtpo_weights(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    seq_entropy: torch.Tensor,
    algorithm: AlgorithmConfig,
    *,
    initial_entropy: float | None = None,
    truncated: torch.Tensor | None = None,
    packed: PackedLayout | None = None,
    scores: torch.Tensor | None = None,
) -> StepWeights:
    """GTPO's advantages and per-token weights of one step (docs/algorithm.md sections 2-4), the trainer's own code.

    Args:
        response_ids: ``[B, T]`` int ids, ``group_size`` rows a prompt; ``[1, N]`` with ``packed``.
        response_mask: same shape, bool, True on response tokens (EOS included).
        rewards: ``[B]`` rewards.
        seq_entropy: ``[B]`` <H>_i in nats.
        algorithm: the algorithm section (other algorithms: ``config.PRESETS[name]``).
        initial_entropy: <H>_ini of the ``paper`` filter.
        truncated: ``[B]`` bool, cut at the token limit.
        packed: where the B sequences sit in a packed row.
        scores: ``[B]`` task scores when ``rewards`` are shaped.

    Returns:
        ``StepWeights``: ``advantages`` (``A_i - gamma <H>_i``), ``token_weights`` (lambda * delta_i), ``keep_mask``
        (delta_i) and ``loss_row_mask``.

    Raises:
        ValueError: shapes, group size, a filter's missing input, a bad ``packed`` layout.
    """
    if packed is None:
        ids, mask = response_ids, response_mask
    else:
        ids, mask = packed.unpack(response_ids), packed.unpack(response_mask)
    if ids.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"rewards has {rewards.shape[0]} entries but response_ids holds {ids.shape[0]} sequences; give one "
            "reward per row, or for a packed row pass packed=PackedLayout.of(seq_starts, seq_lengths)"
        )
    spec = dataclasses.replace(build_loss_spec(algorithm, RolloutConfig()), initial_entropy=initial_entropy)
    weights = compute_weights(
        ids, mask, rewards, algorithm, loss_spec=spec, seq_entropy=seq_entropy, truncated=truncated, scores=scores
    )
    weights = with_entropy_terms(weights, seq_entropy, spec)
    if packed is None:
        return weights
    width = response_mask.shape[-1]
    weights.conflict_weights = packed.pack(weights.conflict_weights, width)
    weights.token_weights = packed.pack(weights.token_weights, width)
    return weights


def loss_normalizer(
    response_masks: Sequence[torch.Tensor], spec: LossSpec, *, group: torch.distributed.ProcessGroup | None
) -> torch.Tensor:
    """The step's global normaliser ``N`` that :func:`legacy_loss` needs (``forward_settings(normalizer=...)``).

    ``response_masks``: this rank's ``[b, S]`` bool masks (unpacked, False on removed rows) of every micro-batch.
    Returns an fp32 scalar, 0 when no rank has a response token. Collectives: one SUM all-reduce on DP ``group``.
    """
    local = sum(
        compute_normalizer(mask, spec.aggregation, max_response_length=spec.max_response_length)
        for mask in response_masks
    )
    return global_normalizer(local, group=group)


def sync_weights(
    model,
    engine: RolloutEngine | None,
    *,
    hf_config,
    groups: ParallelGroups,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> PushStats | None:
    """Push a caller's ``GPTModel`` weights into a rollout engine as Hugging Face tensors in bounded buckets.

    Every rank calls (those outside ``groups.in_weight_gather`` return at once); the engine's owner passes it, the
    others None. Llama, Mistral, Qwen2, Qwen3 and their MoE variants. Returns the owner's ``PushStats``, None
    elsewhere. Collectives: those of ``hf_stream.iter_hf_weights`` (TP / EP all-gathers, PP broadcasts).

    Raises:
        ValueError: a model or HF config the converter cannot map, or sizes that differ from ``hf_config``.
    """
    inner = unwrap_model(model)
    geometry = model_geometry(inner, hf_config, tp_size=groups.tp_size)
    if not groups.in_weight_gather:
        return None
    stream = iter_hf_weights(inner, geometry, groups)
    if engine is None:
        for _ in stream:  # the owner's gather needs every model-parallel rank
            pass
        return None
    return push_weights(engine, stream, bucket_bytes=bucket_bytes)


def attach_lora(model, lora: LoRAConfig, *, hf_config, groups: ParallelGroups, seed: int = 0) -> int:
    """Freeze a caller's ``GPTModel`` stage and add ``lora``'s adapters (``megatron_adapter/lora.py``).

    Call on the unwrapped stage after its base weights are loaded and before Megatron's DDP wraps it (DDP's
    buffers hold the trainable parameters only). The loss forms and :func:`sync_weights` (the merged weights) then
    work unchanged; :func:`save_adapters` writes the adapters alone. Returns this rank's adapter parameter count.

    Raises:
        ValueError: ``lora`` not enabled, or what ``lora.attach_lora`` refuses (Transformer Engine specs, padded
            heads, a target the layer lacks).
    """
    from gtpo_megatron.megatron_adapter.lora import attach_lora as attach

    if not lora.enabled:
        raise ValueError("attach_lora needs LoRAConfig(rank=...); rank=None is full fine-tuning")
    return attach(model, lora, model_geometry(model, hf_config, tp_size=groups.tp_size), seed=seed)


def save_adapters(model, out_dir: str, *, lora: LoRAConfig, groups: ParallelGroups, base_model: str = "") -> int:
    """Write a LoRA-wrapped ``GPTModel``'s adapters as a PEFT folder (peft and vLLM's ``LoRARequest`` load it).

    Every model-parallel rank of the replica calls; global rank 0 writes ``out_dir`` atomically. Returns the
    adapters' bytes. Collectives: ``lora_gather.gather_adapter_tensors`` (TP all-gathers, one PP object gather).
    """
    from gtpo_megatron.megatron_adapter.lora_gather import adapter_spec, gather_adapter_tensors
    from gtpo_megatron.rollout.peft_adapter import folder_bytes, write_adapter_folder

    tensors = gather_adapter_tensors(unwrap_model(model), groups)
    if groups.rank == 0:
        write_adapter_folder(out_dir, tensors, adapter_spec(lora, base_model))
    return folder_bytes(tensors)
