"""The ``model``, ``parallel`` and ``optim`` sections: what Megatron trains and how it is laid out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from gtpo_megatron.config.checks import require as _require
from gtpo_megatron.config.lora import LoRAConfig
from gtpo_megatron.plan.memory import Recompute

ParamsDtype = Literal["float32", "bfloat16"]
"""The dtypes Megatron trains in (``model.params_dtype``; float16 would need a loss scaler)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The model to train and how Megatron holds it (``model.*``)."""

    name_or_path: str
    """Local HF folder, hub name (online users) or a built-in:
    ``builtin:smollm2-135m-instruct|tiny-llama|tiny-qwen2|tiny-qwen3-moe``."""
    params_dtype: ParamsDtype = "bfloat16"
    """Dtype of the Megatron parameters (the optimizer keeps fp32 master weights for 16-bit types)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times tp_size (padded_vocab_size)."""
    recompute: Recompute = "none"
    """Activation recompute granularity passed to Megatron."""
    pad_attention_heads: bool = False
    """Pad the KV groups (zero weights, exact: they stay zero in training) up to a multiple of ``parallel.tp_size``
    when they do not divide it, e.g. SmolLM2-135M's 3 groups x 3 heads at TP=2 (see
    ``megatron_adapter/head_padding.py``). Export and weight sync strip the padding."""
    megatron_overrides: dict[str, object] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields (checked against Megatron's dataclass in ``GTPOConfig.validate``); the
    fields a section or the HF config sets are refused (``megatron_adapter.settings.OWNED_FIELDS``)."""
    megatron_checkpoint: str | None = None
    """A Megatron-LM / Megatron-Bridge checkpoint (``torch_dist`` format: the root holding
    ``latest_checkpointed_iteration.txt``, or one ``iter_NNNNNNN`` folder) whose model weights are the starting
    policy, loaded at any TP/PP layout; weights only (no optimizer state, RNG or iteration count). ``name_or_path``
    then supplies the HF config and tokenizer only (its folder needs no weights); the vLLM engine starts with
    dummy weights and receives these by a weight push before the first rollout. null: start from
    ``name_or_path``'s weights."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of Megatron's load-balancing loss of the router (0, as RL recipes use:
    none is computed). Megatron adds its gradient to each micro-batch's, divided by the number of micro-batches,
    outside the GTPO loss, which ``train/loss`` reports alone (docs/moe.md)."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the router's z-loss (0: none)."""
    fp32_output_layer: bool = True
    """Compute the logits in fp32 when the parameters are bf16/fp16: the output layer multiplies fp32 casts of its
    16-bit input and weight (``megatron_adapter/output_layer.py``), so the log-probs and entropies the loss, the
    filter and the train/rollout mismatch read are not rounded to 16 bits first (up to ~4e-3 nats otherwise). Costs
    fp32 logits and their gradient on the last pipeline stage (``gtpo-plan`` counts it). No effect with fp32
    parameters."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters instead of full fine-tuning (``config/lora.py``; off unless ``model.lora.rank`` is set)."""
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"
    """Megatron's layer spec: ``transformer_engine`` (fused kernels; needs it installed), ``local`` (Megatron's
    PyTorch layers, SDPA attention), ``auto``: Transformer Engine where it imports, except with ``model.lora``
    (``local``: TE fuses the input norm into linear_qkv and linear_fc1, whose adapters need its output)."""

    def __post_init__(self) -> None:
        _require(
            bool(self.name_or_path),
            "model.name_or_path",
            self.name_or_path,
            "must not be empty",
            "give a local HF folder or builtin:smollm2-135m-instruct",
        )
        _require(
            self.make_vocab_size_divisible_by >= 1,
            "model.make_vocab_size_divisible_by",
            self.make_vocab_size_divisible_by,
            "must be >= 1",
            "use 128 (Megatron's default)",
        )
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            _require(0 <= value < math.inf, f"model.{name}", value, "must be finite and >= 0", "use 0 (off) or 1e-3")
        _require(
            not (self.lora.enabled and self.layer_spec == "transformer_engine"),
            "model.layer_spec/model.lora.rank",
            (self.layer_spec, self.lora.rank),
            "Transformer Engine fuses the input norm into linear_qkv and linear_fc1, so their adapters would see the "
            "un-normalised input (not built)",
            "set model.layer_spec=auto (local with LoRA) or local",
        )
        _require(
            self.megatron_checkpoint is None or (bool(self.megatron_checkpoint) and not self.pad_attention_heads),
            "model.megatron_checkpoint/model.pad_attention_heads",
            (self.megatron_checkpoint, self.pad_attention_heads),
            "a Megatron checkpoint is loaded as written (unpadded heads) and must not be empty",
            "set model.pad_attention_heads=false and give the checkpoint folder, or model.megatron_checkpoint=null",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Training parallelism and the distributed backend (``parallel.*``)."""

    tp_size: int = 1
    """Tensor-parallel size (shards heads, MLP and vocabulary)."""
    pp_size: int = 1
    """Pipeline-parallel size (shards layers)."""
    ep_size: int = 1
    """Expert-parallel size of a mixture-of-experts model: each rank holds ``num_experts / ep_size`` whole experts
    (expert tensor parallelism is 1). Megatron forms the EP groups inside each pipeline stage, so ``ep_size`` must
    divide ``world_size / pp_size`` and the model's experts (docs/moe.md). 1 for dense models."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp_size > 1): activations outside the tensor-parallel regions are split
    over the TP ranks along the sequence; with Megatron's local layer specs the norms are
    ``megatron_adapter.model.SequenceParallelRMSNorm``."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states over data-parallel ranks (Megatron distributed optimizer)."""
    cp_size: int = 1
    """Context-parallel size. Megatron's context parallelism runs inside Transformer Engine's attention; only 1 is
    supported (docs/packing.md, "Context parallelism")."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; ``auto`` is ``cpu:gloo,cuda:nccl`` with CUDA (NCCL for CUDA tensors, gloo for CPU
    tensors and objects; ``parallel.groups.CUDA_BACKEND``) and gloo otherwise; ``nccl`` is NCCL alone."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "ep_size"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1", "use 1")
        _require(
            self.cp_size == 1,
            "parallel.cp_size",
            self.cp_size,
            "context parallelism needs Transformer Engine's attention, which this package does not drive (only 1 is "
            "supported)",
            "set parallel.cp_size=1 and fit long sequences with optim.max_tokens_per_micro_batch, model.recompute "
            "and more pipeline stages (docs/packing.md)",
        )
        _require(
            not self.sequence_parallel or self.tp_size > 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            "needs parallel.tp_size > 1",
            "set parallel.sequence_parallel=false",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """Adam, the learning-rate schedule and micro-batching (``optim.*``)."""

    lr: float = 1e-6
    """Peak AdamW learning rate (section 6: 1e-6)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay over trainer.max_steps (== lr for a constant schedule)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 0.1
    """Global gradient-norm clip (section 6: 0.1); 0 disables."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on each data-parallel rank, each padded to the step's longest (unused with
    ``max_tokens_per_micro_batch``)."""
    max_tokens_per_micro_batch: int | None = None
    """Form micro-batches by tokens (docs/packing.md): sequences (prompt + response) are binned, longest first,
    into micro-batches of at most this many forward tokens, padding included, and dealt to the data-parallel ranks
    balanced by tokens; the number of micro-batches then varies from step to step. Must be at least
    ``rollout.max_prompt_len + rollout.max_tokens``. null: ``micro_batch_size`` rows per micro-batch, or with
    ``packing`` the budget of ``micro_batch_size`` full-length rows (``GTPOConfig.max_tokens_per_micro_batch``)."""
    packing: bool = False
    """Under the token budget: pack a micro-batch's sequences into one row (per-sequence position ids,
    attention that cannot cross sequences) instead of right-padding each to the micro-batch's longest."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0", "use 1e-6 (paper)")
        _require(
            0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "must be in [0, optim.lr]", "use 0 or optim.lr"
        )
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")
        for name in ("adam_beta1", "adam_beta2"):
            _require(
                0 <= getattr(self, name) < 1,
                f"optim.{name}",
                getattr(self, name),
                "must be in [0, 1)",
                "use 0.9 / 0.999",
            )
        _require(self.clip_grad >= 0, "optim.clip_grad", self.clip_grad, "must be >= 0", "use 0.1 (paper)")
        _require(self.micro_batch_size >= 1, "optim.micro_batch_size", self.micro_batch_size, "must be >= 1", "use 1")
        _require(
            self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
            "optim.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            "must be >= 1 or null",
            "use at least rollout.max_prompt_len + rollout.max_tokens, or null for micro_batch_size rows",
        )
