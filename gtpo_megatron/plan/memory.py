"""Per-GPU memory and weight-sync estimates for a GTPO run (pure arithmetic on plain inputs).

All sizes are bytes on one GPU. The model (notation, parameters, MoE, optimizer states, activations, the log-prob
working set, the KL reference, the KV cache, the sync) is derived once in docs/scaling.md, "The memory model".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gtpo_megatron.plan.architectures import Architecture

Recompute = Literal["none", "selective", "full"]
"""Megatron's activation recomputation (``model.recompute``): what the backward pass recomputes."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each weight and KV-cache dtype the trainer or the engines hold (``model.params_dtype``,
``GTPOConfig.engine_dtype``): a new engine precision adds its row here."""
GRAD_BYTES = 4
"""Bytes per gradient element (Megatron's fp32 main-grad buffer)."""
FP32_OP_BUFFERS = 2
"""fp32 ``[n, V/t]`` buffers alive at once inside the log-prob/entropy op (forward and backward alike)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingShape:
    """Layout and batch shape of the training side, as plain numbers.

    ``micro_batch_size`` ``b``, ``seq_length`` ``s``, ``num_microbatches`` ``M`` (module notation);
    ``max_tokens_per_micro_batch``: the token budget, which replaces ``b*s`` (None: ``b`` rows of ``s``);
    ``reference_weights``: a KL reference policy's weights stay on the GPU (``kl_coef > 0`` without offload);
    ``ep_size``: expert parallelism (MoE models); ``lora_rank`` and ``lora_projections``: ``model.lora`` (None:
    full fine-tuning).
    """

    tp_size: int
    pp_size: int
    dp_size: int
    micro_batch_size: int
    seq_length: int
    num_microbatches: int
    param_bytes: int = 2
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: Recompute = "none"
    logprob_chunk_size: int | None = None
    fp32_output_layer: bool = False
    reference_weights: bool = False
    max_tokens_per_micro_batch: int | None = None
    ep_size: int = 1
    lora_rank: int | None = None
    lora_projections: tuple[str, ...] = ()

    @property
    def micro_batch_tokens(self) -> int:
        """Forward tokens of one (the largest) micro-batch, ``b*s`` in the module's formulas."""
        return self.max_tokens_per_micro_batch or self.micro_batch_size * self.seq_length


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Bytes held by one GPU of a pipeline stage at the peak of the training phase."""

    stage: int
    params: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    reference: int = 0

    @property
    def static(self) -> int:
        """Bytes that stay resident across phases (weights, gradients, optimizer states, KL reference weights)."""
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def total(self) -> int:
        """Training-phase peak: static bytes plus activations and the log-prob working set."""
        return self.static + self.activations + self.logits


def stage_params(
    arch: Architecture, *, tp_size: int, pp_size: int, padded_vocab_size: int, stage: int, ep_size: int = 1
) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` (see the module docstring for what is sharded)."""
    h = arch.hidden_size
    per_layer_replicated = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    if arch.num_experts:
        per_layer_replicated += arch.num_experts * h + (h if arch.shared_expert_ffn_size else 0)
    experts = arch.num_experts * arch.expert_params()
    per_layer_sharded = arch.layer_params() - per_layer_replicated - experts
    params = (arch.num_layers // pp_size) * (per_layer_sharded // tp_size + per_layer_replicated)
    params += stage_expert_params(arch, pp_size=pp_size, ep_size=ep_size)
    embedding = padded_vocab_size * h // tp_size
    if stage == 0:
        params += embedding
    if stage == pp_size - 1:
        params += h + (embedding if (pp_size > 1 or not arch.tied_embeddings) else 0)
    return params


def stage_lora_params(arch: Architecture, *, rank: int, projections: tuple[str, ...], tp_size: int,
                      pp_size: int) -> int:  # fmt: skip
    """Adapter parameters on one GPU of a stage (``model.lora``).

    Per layer and projection ``r * in + r * out``, the TP-split side divided by ``tp_size`` (``B`` of q/k/v/gate/up,
    ``A`` of o/down; docs/algorithm.md section 6).
    """
    h, f = arch.hidden_size, arch.ffn_hidden_size
    column = {"q_proj": arch.q_width, "k_proj": arch.kv_width, "v_proj": arch.kv_width, "gate_proj": f, "up_proj": f}
    row = {"o_proj": arch.q_width, "down_proj": f}
    per_layer = sum(rank * (h + column[p] // tp_size) if p in column else rank * (row[p] // tp_size + h)
                    for p in projections)  # fmt: skip
    return (arch.num_layers // pp_size) * per_layer


def stage_expert_params(arch: Architecture, *, pp_size: int, ep_size: int) -> int:
    """Expert parameters held by one GPU of a stage: ``E/e`` experts of each of its ``L/p`` layers (0 when dense)."""
    return (arch.num_layers // pp_size) * (arch.num_experts // ep_size) * arch.expert_params()


def optimizer_bytes(
    params: int, *, param_bytes: int, dp_size: int, distributed_optimizer: bool, expert_params: int = 0,
    expert_dp_size: int = 1,
) -> int:  # fmt: skip
    """Adam m and v in fp32, plus fp32 master weights for 16-bit parameters; sharded when distributed.

    With the distributed optimizer the ``params - expert_params`` dense parameters' states are sharded over DP and
    the ``expert_params`` experts' over their expert-data-parallel group (``expert_dp_size`` ranks).
    """
    per_param = 8 + (4 if param_bytes < 4 else 0)
    if not distributed_optimizer:
        return params * per_param
    dense = params - expert_params
    return -(-dense * per_param // dp_size) - (-expert_params * per_param // expert_dp_size)


def layer_activation_bytes(arch: Architecture, shape: TrainingShape) -> int:
    """Bytes one layer keeps for backward for one micro-batch without recompute (module docstring formula)."""
    sb = shape.micro_batch_tokens
    replicated = 4 * arch.hidden_size
    mlp = 3 * arch.ffn_hidden_size
    if arch.num_experts:
        mlp = arch.top_k * (arch.hidden_size + 3 * arch.expert_ffn_size) + 3 * arch.shared_expert_ffn_size
    sharded = 2 * arch.q_width + 2 * arch.kv_width + mlp
    if shape.sequence_parallel:
        return shape.param_bytes * sb * (replicated + sharded) // shape.tp_size
    return shape.param_bytes * sb * (replicated + sharded // shape.tp_size)


def activation_bytes(arch: Architecture, shape: TrainingShape, *, stage: int) -> int:
    """Activation bytes of stage ``stage`` at its peak: in-flight micro-batches times its layers' share."""
    layers = arch.num_layers // shape.pp_size
    in_flight = min(shape.pp_size - stage, shape.num_microbatches)
    full_layer = layer_activation_bytes(arch, shape)
    if shape.recompute != "full":
        return in_flight * layers * full_layer
    sb = shape.micro_batch_tokens
    layer_input = shape.param_bytes * sb * arch.hidden_size // (shape.tp_size if shape.sequence_parallel else 1)
    return in_flight * layers * layer_input + full_layer


def logits_bytes(vocab_per_rank: int, *, tokens: int, param_bytes: int, chunk_size: int | None) -> int:
    """Working set of the log-prob/entropy op on the last stage for ``tokens = b*s`` tokens.

    ``vocab_per_rank`` ``V/t``; ``param_bytes`` of the logits dtype; ``chunk_size`` None: the whole micro-batch.
    """
    fp32_rows = tokens if chunk_size is None else min(chunk_size, tokens)
    return 2 * param_bytes * tokens * vocab_per_rank + FP32_OP_BUFFERS * 4 * fp32_rows * vocab_per_rank


def logprob_working_set_bytes(
    vocab_per_rank: int,
    *,
    tokens: int,
    hidden_size: int,
    param_bytes: int,
    chunk_size: int | None,
    fp32_output_layer: bool,
) -> int:
    """Peak bytes of the logits, the log-prob/entropy op and, with an fp32 output layer, that layer's backward.

    ``vocab_per_rank`` V/t, ``tokens`` b*s of one micro-batch, ``hidden_size`` h, ``param_bytes`` 2 or 4,
    ``chunk_size`` (``algorithm.logprob_chunk_size``). Returns :func:`logits_bytes` in the parameter dtype; with
    ``fp32_output_layer`` and 16-bit parameters ``max(logits_bytes(param_bytes=4), 4*b*s*V/t + 10*V/t*h)``.
    """
    if not fp32_output_layer or param_bytes >= 4:
        return logits_bytes(vocab_per_rank, tokens=tokens, param_bytes=param_bytes, chunk_size=chunk_size)
    op_phase = logits_bytes(vocab_per_rank, tokens=tokens, param_bytes=4, chunk_size=chunk_size)
    return max(op_phase, 4 * tokens * vocab_per_rank + 10 * vocab_per_rank * hidden_size)


def estimate_stage(arch: Architecture, shape: TrainingShape, *, padded_vocab_size: int, stage: int) -> StageMemory:
    """Training-phase memory of one GPU in pipeline stage ``stage`` (0-based)."""
    params = stage_params(
        arch, tp_size=shape.tp_size, pp_size=shape.pp_size, padded_vocab_size=padded_vocab_size, stage=stage,
        ep_size=shape.ep_size,
    )  # fmt: skip
    is_last = stage == shape.pp_size - 1
    logits = (
        logprob_working_set_bytes(
            padded_vocab_size // shape.tp_size,
            tokens=shape.micro_batch_tokens,
            hidden_size=arch.hidden_size,
            param_bytes=shape.param_bytes,
            chunk_size=shape.logprob_chunk_size,
            fp32_output_layer=shape.fp32_output_layer,
        )
        if is_last
        else 0
    )
    trainable, frozen_experts = params, stage_expert_params(arch, pp_size=shape.pp_size, ep_size=shape.ep_size)
    if shape.lora_rank is not None:  # the base is frozen: gradients and Adam states for the adapters only
        trainable = stage_lora_params(arch, rank=shape.lora_rank, projections=shape.lora_projections,
                                      tp_size=shape.tp_size, pp_size=shape.pp_size)  # fmt: skip
        frozen_experts = 0
    return StageMemory(
        stage=stage,
        params=params,
        weights=(params + (trainable if shape.lora_rank is not None else 0)) * shape.param_bytes,
        grads=trainable * GRAD_BYTES,
        optimizer=optimizer_bytes(
            trainable,
            param_bytes=shape.param_bytes,
            dp_size=shape.dp_size,
            distributed_optimizer=shape.distributed_optimizer,
            expert_params=frozen_experts,
            expert_dp_size=max(shape.tp_size * shape.dp_size // shape.ep_size, 1),
        ),
        activations=activation_bytes(arch, shape, stage=stage),
        logits=logits,
        reference=params * shape.param_bytes if shape.reference_weights else 0,
    )


def kv_cache_bytes_per_token(arch: Architecture, *, engine_tp_size: int, kv_bytes: int) -> int:
    """KV-cache bytes one token occupies on one GPU of a vLLM engine with tensor parallelism ``engine_tp_size``."""
    kv_heads = max(1, arch.num_query_groups // engine_tp_size)
    return 2 * arch.num_layers * kv_heads * arch.head_dim * kv_bytes


def engine_weight_bytes(arch: Architecture, *, engine_tp_size: int, param_bytes: int) -> int:
    """Bytes of the rollout engine's weights on one of its GPUs (unpadded vocabulary, sharded by engine TP)."""
    return -(-arch.total_params() * param_bytes // engine_tp_size)


def weight_sync_seconds(arch: Architecture, *, param_bytes: int, bandwidth_gbps: float) -> float:
    """Seconds to move every parameter once in ``param_bytes`` over a ``bandwidth_gbps`` gigabit/s link."""
    return arch.total_params() * param_bytes * 8 / (bandwidth_gbps * 1e9)
