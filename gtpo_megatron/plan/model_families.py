"""What differs between the decoder families the converter builds: one frozen record per HF ``model_type``.

All of them are Megatron's GPT block (RMSNorm, SwiGLU, GQA, RoPE; the common fields are docs/models.md's table). A
record holds the attention's biases and q/k norms, which layers have a sliding window, and for a mixture of experts
the keys of its sizes, its router's renormalisation and the HF names of its router, experts and shared expert
(docs/moe.md). ``plan.architectures`` (sizes, parameter counts), ``megatron_adapter.hf_features`` (biases, norms,
windows), ``megatron_adapter.moe.features`` (sizes, routing) and ``megatron_adapter.hf_conversion`` (names) read
it; the supported types are its keys. Torch-free: a ``config`` here is a parsed ``config.json`` (a dict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Flag:
    """A yes/no of a family: the ``config.json`` key ``key`` when set (not null), else ``default`` (no key: fixed)."""

    default: bool = False
    key: str | None = None

    def read(self, config: dict) -> bool:
        """The flag's value for ``config``."""
        value = config.get(self.key) if self.key else None
        return self.default if value is None else bool(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEFamily:
    """The mixture-of-experts part of a family: size keys, routing, and HF names under ``model.layers.{i}``."""

    width_key: str
    """Key of one expert's SwiGLU width ``f_e``."""
    shared_width_key: str | None = None
    """Key of the shared expert's width ``f_s`` (None: the family has no shared expert)."""
    renormalize: Flag
    """HF renormalises the top-k routing weights over the k (``norm_topk_prob``)."""
    all_sparse: tuple[tuple[str, object], ...] = ()
    """Keys that can make a layer dense, each with its value when every layer is an MoE layer (a list as a tuple);
    another value is refused (:meth:`has_dense_layers`)."""
    block: str = "mlp"
    """The layer's submodule that holds the router and the experts."""
    router: str = "gate"
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """An expert's gate, up and down projections; a shared expert's are named the same."""
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    """The shared expert's ``[1, h]`` sigmoid gate (None: ungated)."""

    def has_dense_layers(self, config: dict) -> bool:
        """True when a key of :attr:`all_sparse` is set in ``config`` to another value than its all-sparse one."""
        found = {key: config.get(key) for key, _ in self.all_sparse}
        found = {key: tuple(value) if isinstance(value, list) else value for key, value in found.items()}
        return any(found[key] not in (None, sparse) for key, sparse in self.all_sparse)

    def router_name(self, layer: int) -> str:
        """HF name of layer ``layer``'s router ``[E, h]``."""
        return f"model.layers.{layer}.{self.block}.{self.router}.weight"

    def hf_expert_name(self, layer: int, expert: int, which: int) -> str:
        """``model.layers.{layer}.{block}.experts.{expert}.{gate|up|down}.weight`` (``which`` 0, 1, 2)."""
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{self.expert_linears[which]}.weight"

    def shared_expert_name(self, layer: int, which: int) -> str:
        """HF name of the shared expert's gate, up or down projection (``which`` 0, 1, 2)."""
        return f"model.layers.{layer}.{self.block}.{self.shared_expert}.{self.expert_linears[which]}.weight"

    def shared_gate_name(self, layer: int) -> str:
        """HF name of the shared expert's gate ``[1, h]``."""
        return f"model.layers.{layer}.{self.block}.{self.shared_expert_gate}.weight"


Windows = Literal["every_layer", "layer_types", "none"]
"""Where ``sliding_window`` applies: every layer when not null, the ``sliding_attention`` entries of
``layer_types``, or nowhere (the family has no windows)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """One ``model_type``: which linears have biases, q/k norms, windows and (None: dense) its experts."""

    qkv_bias: Flag = Flag()
    proj_bias: Flag = Flag()
    """o_proj's bias."""
    mlp_bias: Flag = Flag()
    qk_norm: bool = False
    """Per-head q/k RMSNorms (two ``head_dim`` vectors a layer)."""
    windows: Windows = "none"
    moe: MoEFamily | None = None


_ATTENTION_BIAS = Flag(key="attention_bias")
_QWEN_ALL_SPARSE = (("mlp_only_layers", ()), ("decoder_sparse_step", 1))
FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(qkv_bias=_ATTENTION_BIAS, proj_bias=_ATTENTION_BIAS, mlp_bias=Flag(key="mlp_bias")),
    "mistral": ModelFamily(windows="every_layer"),
    "qwen2": ModelFamily(qkv_bias=Flag(True), windows="layer_types"),
    "qwen3": ModelFamily(qkv_bias=_ATTENTION_BIAS, proj_bias=_ATTENTION_BIAS, qk_norm=True, windows="layer_types"),
    "qwen3_moe": ModelFamily(
        qkv_bias=_ATTENTION_BIAS,
        proj_bias=_ATTENTION_BIAS,
        qk_norm=True,
        windows="every_layer",
        moe=MoEFamily(
            width_key="moe_intermediate_size", renormalize=Flag(key="norm_topk_prob"), all_sparse=_QWEN_ALL_SPARSE
        ),
    ),
    "qwen2_moe": ModelFamily(
        qkv_bias=Flag(True, key="qkv_bias"),
        windows="layer_types",
        moe=MoEFamily(
            width_key="moe_intermediate_size",
            shared_width_key="shared_expert_intermediate_size",
            renormalize=Flag(key="norm_topk_prob"),
            all_sparse=_QWEN_ALL_SPARSE,
            shared_expert="shared_expert",
            shared_expert_gate="shared_expert_gate",
        ),
    ),
    "mixtral": ModelFamily(
        windows="every_layer",
        moe=MoEFamily(
            width_key="intermediate_size",
            renormalize=Flag(True),
            block="block_sparse_moe",
            expert_linears=("w1", "w3", "w2"),
        ),
    ),
}
"""The families ``transformers`` builds as listed (the keys its modeling code reads; docs/models.md, docs/moe.md)."""
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
MOE_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if family.moe)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Keys that count a layer's experts, in any family (Qwen and OLMoE, Mixtral, DeepSeek): an unbuilt MoE type is
recognised, and refused, by them."""


def planning_family(model_type: str) -> ModelFamily:
    """The family of ``model_type``; a type the converter does not build is planned as Llama (``attention_bias``)."""
    return FAMILIES.get(model_type, FAMILIES["llama"])


def moe_sizes(config: dict) -> dict:
    """The expert sizes of a parsed MoE ``config.json`` (``{}`` for a dense one), under ``Architecture``'s names.

    ``num_experts`` (any of :data:`EXPERT_COUNT_KEYS`), ``expert_ffn_size`` (the family's ``width_key``),
    ``top_k`` (``num_experts_per_tok``, default 2), ``shared_expert_ffn_size`` (0: none).

    Raises:
        ValueError: experts in a ``model_type`` outside :data:`MOE_MODEL_TYPES` (DeepSeek-V3, OLMoE, ...).
    """
    experts = int(next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key)), 0))
    if not experts:
        return {}
    model_type = config.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is a mixture of experts ({experts} experts a layer) that is not built here; "
            f"the mixture-of-experts types are {list(MOE_MODEL_TYPES)} (docs/moe.md): use one of those"
        )
    moe = FAMILIES[model_type].moe
    shared = config.get(moe.shared_width_key) if moe.shared_width_key else None
    return dict(
        num_experts=experts,
        expert_ffn_size=int(config[moe.width_key]),
        top_k=int(config.get("num_experts_per_tok", 2)),
        shared_expert_ffn_size=int(shared or 0),
    )
