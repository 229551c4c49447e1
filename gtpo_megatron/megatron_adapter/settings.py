"""What a run hands Megatron, resolved once from the config sections: ``PolicySettings`` (torch-free).

``policy_settings(cfg)`` is the one reader of the ``model``, ``parallel`` and ``optim`` sections for the policy:
``MegatronPolicy`` builds its ``TransformerConfig``, DDP and optimizer configs from them only, and ``gtpo-plan``
reports on the same object (``validation.validate_config`` adds what the config package may not read).
``model.megatron_overrides`` may set any ``TransformerConfig`` field but those of :data:`OWNED_FIELDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, get_args

from gtpo_megatron.config.model import ParamsDtype
from gtpo_megatron.plan.layout import padded_vocab_size
from gtpo_megatron.plan.micro_batches import TokenBudget

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig, ModelConfig

PARAMS_DTYPES = get_args(ParamsDtype)
"""Parameter dtypes the Megatron policy trains in: the config's own choice, re-checked for configs built in code."""

_FROM_HF = "the model's config.json"
OWNED_FIELDS: dict[str, str] = {
    "tensor_model_parallel_size": "parallel.tp_size",
    "pipeline_model_parallel_size": "parallel.pp_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "params_dtype": "model.params_dtype",
    "pipeline_dtype": "model.params_dtype",
    "bf16": "model.params_dtype",
    "fp16": "model.params_dtype",
    "recompute_granularity": "model.recompute",
    "recompute_method": "model.recompute",
    "recompute_num_layers": "model.recompute",
    "variable_seq_lengths": "optim.max_tokens_per_micro_batch at parallel.pp_size > 1",
    "moe_token_dispatcher_type": "moe.features (and optim.max_tokens_per_micro_batch at parallel.pp_size > 1)",
    "expert_model_parallel_size": "parallel.ep_size",
    "expert_tensor_parallel_size": "moe.features (expert tensor parallelism is 1)",
    "moe_router_load_balancing_type": "model.moe_aux_loss_coeff",
    "moe_aux_loss_coeff": "model.moe_aux_loss_coeff",
    "moe_z_loss_coeff": "model.moe_z_loss_coeff",
    "moe_grouped_gemm": "the layer spec (Transformer Engine's grouped experts, else SequentialMLP)",
    "moe_expert_capacity_factor": "moe.features (dropless routing)",
    "calculate_per_token_loss": "the loss normalisation contract (megatron_adapter/forward_step.py)",
    "perform_initialization": "the tensor-parallel weight tags Megatron sets while initialising (model.py)",
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
            "window_size",
            "window_attn_skip_freq",
            "num_moe_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_router_pre_softmax",
            "moe_router_score_function",
            "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate",
            "moe_layer_freq",
            "moe_router_topk_scaling_factor",
            "moe_input_jitter_eps",
            "moe_router_enable_expert_bias",
            "moe_router_num_groups",
            "moe_router_group_topk",
        ),
        _FROM_HF,
    ),
}
"""``TransformerConfig`` fields set from a config section, from the HF config or by a contract of this package:
``model.megatron_overrides`` may not set them (``tests/adapter/test_config_wiring.py`` keeps this list equal to what
``model.transformer_config_from_hf`` derives)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimSettings:
    """Adam and LR-schedule settings (plain values; ``policy_settings`` maps the ``optim`` section onto them).

    Linear warm-up to ``lr``, then ``decay_style`` to ``min_lr`` at ``total_steps``; ``clip_grad`` 0: no clipping.

    Raises:
        ValueError: ``lr <= 0``, ``min_lr`` outside ``[0, lr]``, ``warmup_steps`` outside ``[0, total_steps)`` or an
            unknown ``decay_style``.
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1_000_000
    decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (fp32 main weights and Adam states sharded over the DP group)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.lr={self.lr} must be > 0 and optim.min_lr={self.min_lr} in [0, lr]")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps} must be in [0, optim.total_steps={self.total_steps})"
            )
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.decay_style={self.decay_style!r}; choose constant, linear or cosine")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicySettings:
    """Everything ``MegatronPolicy.from_pretrained`` builds from; each field is the config field of its name.

    Raises:
        ValueError: ``model.params_dtype`` not in :data:`PARAMS_DTYPES`, ``micro_batch_size < 1``, sequence
            parallelism at ``tp_size == 1``, or an override of an :data:`OWNED_FIELDS` field.
    """

    model: ModelConfig
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    optim: OptimSettings = field(default_factory=OptimSettings)
    micro_batch_size: int = 1
    token_budget: TokenBudget | None = None
    """Micro-batches by tokens (``optim.max_tokens_per_micro_batch``, ``optim.packing``); None: by rows."""
    logprob_chunk_size: int | None = None
    seed: int = 1234
    routing_replay: bool = False
    """``rollout.routing_replay == "rollout"``: the routers replay each batch's ``routed_experts``."""

    def __post_init__(self) -> None:
        if self.model.params_dtype not in PARAMS_DTYPES:
            raise ValueError(
                f"model.params_dtype={self.model.params_dtype!r}: the Megatron policy trains in "
                f"{list(PARAMS_DTYPES)}; set model.params_dtype=bfloat16 (or float32)"
            )
        if self.micro_batch_size < 1:
            raise ValueError(f"optim.micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.sequence_parallel and self.tp_size < 2:
            raise ValueError(
                f"parallel.sequence_parallel=true needs parallel.tp_size > 1 (got {self.tp_size}); "
                "set parallel.sequence_parallel=false"
            )
        check_overrides(self.model.megatron_overrides)

    def padded_vocab_size(self, vocab_size: int, *, padding_tp_size: int | None = None) -> int:
        """``V`` of the embedding and output layer, padded at ``lcm(tp_size, padding_tp_size)``."""
        tp = math.lcm(self.tp_size, padding_tp_size or self.tp_size)
        return padded_vocab_size(vocab_size, make_vocab_size_divisible_by=self.model.make_vocab_size_divisible_by,
                                 tp_size=tp)  # fmt: skip


def check_overrides(overrides: dict[str, object]) -> None:
    """Refuse ``model.megatron_overrides`` keys in :data:`OWNED_FIELDS`.

    Raises:
        ValueError: naming every such key and what sets it instead.
    """
    owned = {key: OWNED_FIELDS[key] for key in overrides if key in OWNED_FIELDS}
    if owned:
        sources = ", ".join(f"{key} (set by {source})" for key, source in sorted(owned.items()))
        raise ValueError(
            f"model.megatron_overrides sets {sources}: these fields are not free; set the named config field "
            "instead, or drop the override"
        )


def policy_settings(cfg: GTPOConfig) -> PolicySettings:
    """The run's ``PolicySettings``: the model, parallel and optim sections, ``trainer.seed``, the chunk size.

    The LR decays over ``trainer.max_steps * algorithm.num_updates_per_batch`` optimizer steps.

    Raises:
        ValueError: see :class:`PolicySettings`.
    """
    optim = cfg.optim
    return PolicySettings(
        model=cfg.model,
        tp_size=cfg.parallel.tp_size,
        pp_size=cfg.parallel.pp_size,
        ep_size=cfg.parallel.ep_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
        optim=OptimSettings(
            lr=optim.lr,
            min_lr=optim.min_lr,
            warmup_steps=optim.warmup_steps,
            total_steps=max(cfg.trainer.max_steps * cfg.algorithm.num_updates_per_batch, optim.warmup_steps + 1),
            decay_style="constant" if optim.min_lr == optim.lr else "cosine",
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            clip_grad=optim.clip_grad,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        ),
        micro_batch_size=optim.micro_batch_size,
        token_budget=None
        if cfg.max_tokens_per_micro_batch is None
        else TokenBudget(max_tokens=cfg.max_tokens_per_micro_batch, packing=optim.packing),
        logprob_chunk_size=cfg.algorithm.logprob_chunk_size,
        seed=cfg.trainer.seed,
        routing_replay=cfg.rollout.routing_replay == "rollout",
    )
