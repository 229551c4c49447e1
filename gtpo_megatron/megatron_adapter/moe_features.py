"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the HF router and expert fields and Megatron's.

Every decoder layer of an accepted model is one ``MoELayer`` (docs/moe.md has the field table):

* router: HF ``softmax(logits) -> top-k``, renormalised over the k when ``norm_topk_prob`` (Qwen3-MoE, Qwen2-MoE)
  and always for Mixtral. Megatron's ``moe_router_pre_softmax=False`` is ``top-k(logits) -> softmax`` over the k,
  the same renormalised weights; ``True`` is ``softmax -> top-k``, HF without renormalisation.
* experts: ``num_experts`` SwiGLU MLPs of width ``moe_intermediate_size`` (Mixtral: ``intermediate_size``), dropless
  (no capacity factor). Qwen2-MoE adds a shared expert of width ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` (``moe_shared_expert_gate``).
* HF tensor names: ``{block}.gate.weight`` (router) and ``{block}.experts.{e}.{gate, up, down}`` with
  ``block = model.layers.{i}.mlp`` (Mixtral: ``model.layers.{i}.block_sparse_moe`` and ``w1, w3, w2``).

Expert tensor parallelism is 1: each expert is whole on one rank, EP ranks hold ``num_experts / ep_size`` each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gtpo_megatron.plan.architectures import MOE_MODEL_TYPES, moe_sizes

if TYPE_CHECKING:
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

_HF_ROUTING = dict(
    moe_layer_freq=1,
    moe_router_topk_scaling_factor=None,
    moe_input_jitter_eps=None,
    moe_router_enable_expert_bias=False,
    moe_router_num_groups=None,
    moe_router_group_topk=None,
)
"""Megatron's routing options that HF's (and vLLM's) routers of these types do not have, pinned to their no-op
values: every layer an MoE layer, no weight scaling, jitter, expert bias or group-limited top-k."""
_EXPERT_LINEARS = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoEShape:
    """The experts of every layer: counts, widths (0: no shared expert), routing and the HF naming scheme."""

    num_experts: int
    top_k: int
    expert_ffn_size: int
    shared_expert_ffn_size: int
    renormalize: bool
    block: str
    """``mlp`` or ``block_sparse_moe``: the HF submodule of a layer that holds the router and experts."""
    expert_linears: tuple[str, str, str]
    """HF names of an expert's gate, up and down projections."""

    def hf_expert_name(self, layer: int, expert: int, which: int) -> str:
        """``model.layers.{layer}.{block}.experts.{expert}.{gate|up|down}.weight`` (``which`` 0, 1, 2)."""
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{self.expert_linears[which]}.weight"


def moe_shape(hf_config) -> MoEShape | None:
    """The ``MoEShape`` of an accepted MoE config (``check_moe_config`` first); None for a dense model type."""
    model_type = hf_config.model_type
    if model_type not in MOE_MODEL_TYPES:
        return None
    mixtral = model_type == "mixtral"
    return MoEShape(
        **moe_sizes(hf_config.to_dict()),
        renormalize=mixtral or bool(getattr(hf_config, "norm_topk_prob", False)),
        block="block_sparse_moe" if mixtral else "mlp",
        expert_linears=_EXPERT_LINEARS.get(model_type, _DEFAULT_EXPERT_LINEARS),
    )


def check_moe_config(hf_config) -> None:
    """Refuse the MoE settings the Megatron model cannot reproduce.

    ``hf_features`` warns about Mixtral's training-only ``router_jitter_noise``.

    Raises:
        ValueError: dense layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step != 1``), no
            experts, or a top-k outside ``[1, num_experts]``, each naming the config key.
    """
    if hf_config.model_type in ("qwen3_moe", "qwen2_moe"):
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        if dense or step != 1:
            raise ValueError(
                f"mlp_only_layers={dense}, decoder_sparse_step={step}: dense MLP layers among the MoE layers are "
                "not built here (every layer is an MoE layer); use a checkpoint with mlp_only_layers=[] and "
                "decoder_sparse_step=1"
            )
    sizes = moe_sizes(hf_config.to_dict())
    experts, top_k = sizes.get("num_experts", 0), sizes.get("top_k", 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(
            f"num_experts={experts}, num_experts_per_tok={top_k}: need at least one expert and "
            "1 <= num_experts_per_tok <= num_experts; fix the checkpoint's config.json"
        )


def moe_transformer_fields(hf_config, settings: PolicySettings, *, grouped_gemm: bool) -> dict:
    """Megatron's MoE ``TransformerConfig`` fields for ``hf_config`` (``{}`` for a dense model).

    Dropless routing, expert TP 1 and EP ``settings.ep_size``, the ``alltoall`` dispatcher (Megatron's ``allgather``
    one refuses the variable micro-batch shapes of token budgets under PP), the router's load-balancing and z-losses
    of ``model.moe_aux_loss_coeff`` / ``model.moe_z_loss_coeff`` (0: none), and ``grouped_gemm`` as the layer spec
    (Transformer Engine's grouped experts, else ``SequentialMLP``).
    """
    shape = moe_shape(hf_config)
    if shape is None:
        return {}
    model = settings.model
    shared = {}
    if shape.shared_expert_ffn_size:
        shared = dict(moe_shared_expert_intermediate_size=shape.shared_expert_ffn_size, moe_shared_expert_gate=True)
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.top_k,
        moe_ffn_hidden_size=shape.expert_ffn_size,
        moe_router_pre_softmax=not shape.renormalize,
        moe_router_score_function="softmax",
        **_HF_ROUTING,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=settings.ep_size,
        expert_tensor_parallel_size=1,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff or None,
        **shared,
    )
