"""What a run hands Megatron, resolved once from the config sections: ``PolicySettings`` (torch-free).

``policy_settings(cfg)`` is the one reader of the ``model``, ``parallel`` and ``optim`` sections for the policy:
``MegatronPolicy`` builds its ``TransformerConfig``, DDP and optimizer configs from them only, and ``gtpo-plan``
reports on the same object (``validation.validate_config`` adds what the config package may not read).
``model.megatron_overrides`` may set any ``TransformerConfig`` field but those of :data:`OWNED_FIELDS`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from gtpo_megatron.config.model import OptimConfig, ParallelConfig, ParamsDtype
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
class LRSchedule:
    """The LR schedule's span and shape, derived from the run (no config field of their own).

    Linear warm-up over ``optim.warmup_steps`` to ``optim.lr``, then ``decay_style`` to ``optim.min_lr`` at
    ``total_steps`` optimizer steps (``megatron_adapter/optimizer.py``).
    """

    total_steps: int = 1_000_000
    decay_style: Literal["constant", "linear", "cosine"] = "constant"


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicySettings:
    """Everything ``MegatronPolicy.from_pretrained`` builds from: the config's sections and what the run derives.

    ``parallel`` and ``optim`` are the config's sections as they are (their rules are theirs, checked when they are
    built); ``adam_eps`` has no config field.

    Raises:
        ValueError: ``model.params_dtype`` not in :data:`PARAMS_DTYPES` or an override of an :data:`OWNED_FIELDS`
            field.
    """

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: LRSchedule = field(default_factory=LRSchedule)
    adam_eps: float = 1e-8
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
        check_overrides(self.model.megatron_overrides)

    @property
    def tp_size(self) -> int:
        """``parallel.tp_size``."""
        return self.parallel.tp_size

    @property
    def pp_size(self) -> int:
        """``parallel.pp_size``."""
        return self.parallel.pp_size

    @property
    def ep_size(self) -> int:
        """``parallel.ep_size``."""
        return self.parallel.ep_size

    @property
    def sequence_parallel(self) -> bool:
        """``parallel.sequence_parallel``."""
        return self.parallel.sequence_parallel

    @property
    def micro_batch_size(self) -> int:
        """``optim.micro_batch_size``."""
        return self.optim.micro_batch_size

    @property
    def token_budget(self) -> TokenBudget | None:
        """Micro-batches by tokens (``optim.max_tokens_per_micro_batch``, ``optim.packing``); None: by rows."""
        budget = self.optim.max_tokens_per_micro_batch
        return None if budget is None else TokenBudget(max_tokens=budget, packing=self.optim.packing)

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

    ``optim`` carries the run's token budget (``GTPOConfig.max_tokens_per_micro_batch``). The LR decays over
    ``trainer.max_steps * algorithm.num_updates_per_batch`` optimizer steps, by cosine unless ``optim.min_lr ==
    optim.lr``.

    Raises:
        ValueError: see :class:`PolicySettings`.
    """
    optim = dataclasses.replace(cfg.optim, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)  # packing alone
    return PolicySettings(
        model=cfg.model,
        parallel=cfg.parallel,
        optim=optim,
        schedule=LRSchedule(
            total_steps=max(cfg.trainer.max_steps * cfg.algorithm.num_updates_per_batch, optim.warmup_steps + 1),
            decay_style="constant" if optim.min_lr == optim.lr else "cosine",
        ),
        logprob_chunk_size=cfg.algorithm.logprob_chunk_size,
        seed=cfg.trainer.seed,
        routing_replay=cfg.rollout.routing_replay == "rollout",
    )
