"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the HF router and expert fields and Megatron's.

Every decoder layer of an accepted model is one ``MoELayer`` (docs/moe.md has the field table; each family's keys
and names are its ``plan.model_families`` record):

* router: HF ``softmax(logits) -> top-k``, renormalised over the k when the family says so (``norm_topk_prob``).
  Megatron's ``moe_router_pre_softmax=False`` is ``top-k(logits) -> softmax`` over the k, the same renormalised
  weights; ``True`` is ``softmax -> top-k``, HF without renormalisation.
* experts: ``num_experts`` SwiGLU MLPs of the family's width key, dropless (no capacity factor); a family with a
  shared expert adds one, scaled by ``sigmoid(shared_expert_gate(x))`` when it is gated (``moe_shared_expert_gate``).

Expert tensor parallelism is 1: each expert is whole on one rank, EP ranks hold ``num_experts / ep_size`` each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gtpo_megatron.plan.model_families import FAMILIES, MoEFamily, moe_sizes

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


@dataclass(frozen=True)
class MoEShape:
    """The experts of every layer: counts, widths (0: no shared expert), routing and the family's HF names."""

    num_experts: int
    top_k: int
    expert_ffn_size: int
    shared_expert_ffn_size: int
    renormalize: bool
    family: MoEFamily


def moe_shape(hf_config) -> MoEShape | None:
    """The ``MoEShape`` of an accepted MoE config (``check_moe_config`` first); None for a dense model type."""
    family = FAMILIES.get(hf_config.model_type)
    if family is None or family.moe is None:
        return None
    config = hf_config.to_dict()
    return MoEShape(**moe_sizes(config), renormalize=family.moe.renormalize.read(config), family=family.moe)


def check_moe_config(hf_config) -> None:
    """Refuse the MoE settings the Megatron model cannot reproduce.

    ``hf_features`` warns about Mixtral's training-only ``router_jitter_noise``.

    Raises:
        ValueError: dense layers among the sparse ones (the family's ``all_sparse`` keys), no experts, or a top-k
            outside ``[1, num_experts]``, each naming the config key.
    """
    config, moe = hf_config.to_dict(), FAMILIES[hf_config.model_type].moe
    if moe.has_dense_layers(config):
        values = {key: sparse if config.get(key) is None else config[key] for key, sparse in moe.all_sparse}
        raise ValueError(
            ", ".join(f"{key}={json.dumps(value)}" for key, value in values.items())
            + ": dense MLP layers among the MoE layers are not built here (every layer is an MoE layer); use a "
            "checkpoint with " + " and ".join(f"{key}={json.dumps(sparse)}" for key, sparse in moe.all_sparse)
        )
    sizes = moe_sizes(config)
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
        gated = shape.family.shared_expert_gate is not None
        shared = dict(moe_shared_expert_intermediate_size=shape.shared_expert_ffn_size, moe_shared_expert_gate=gated)
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
