"""Mixture-of-experts configs (single process): router and expert fields per model type, the refusals at load and
in ``GTPOConfig.validate``, and the HF names of every expert parameter (the logits and gradient parity of the built
models against ``transformers`` is in ``tests/distributed/test_moe_parity.py``)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from gtpo_megatron.config import ParallelConfig, load_config
from gtpo_megatron.megatron_adapter import hf_conversion as hc
from gtpo_megatron.megatron_adapter.hf_features import check_hf_config
from gtpo_megatron.megatron_adapter.model import hf_transformer_fields
from gtpo_megatron.megatron_adapter.settings import PolicySettings
from tests.adapter.megatron_helpers import model_section
from tests.helpers.tiny_configs import SMALL

EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)


def _fields(hf_config, **settings) -> dict:
    return hf_transformer_fields(
        hf_config, PolicySettings(model=model_section("x"), parallel=ParallelConfig(**settings))
    )


@pytest.mark.parametrize(
    ("hf_config", "pre_softmax", "expert_ffn", "shared_ffn"),
    [
        # HF softmax -> top-k -> renormalise equals Megatron's top-k -> softmax (pre_softmax False)
        (Qwen3MoeConfig(**SMALL, **EXPERTS, norm_topk_prob=True), False, 48, None),
        (Qwen3MoeConfig(**SMALL, **EXPERTS, norm_topk_prob=False), True, 48, None),
        (Qwen2MoeConfig(**SMALL, **EXPERTS, shared_expert_intermediate_size=96), True, 48, 96),
        (MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2), False, SMALL["intermediate_size"], None),
    ],
)
def test_router_and_expert_fields_follow_the_hf_config(hf_config, pre_softmax, expert_ffn, shared_ffn):
    fields = _fields(hf_config, ep_size=4)
    assert fields["moe_router_pre_softmax"] is pre_softmax
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_ffn_hidden_size"]) == (8, 2, expert_ffn)
    assert fields.get("moe_shared_expert_intermediate_size") == shared_ffn
    assert fields.get("moe_shared_expert_gate", False) is (shared_ffn is not None)
    assert (fields["expert_model_parallel_size"], fields["expert_tensor_parallel_size"]) == (4, 1)
    assert fields["moe_expert_capacity_factor"] is None  # dropless
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"]) == ("none", 0.0)


def test_load_balancing_loss_comes_from_the_model_section():
    settings = PolicySettings(model=model_section("x", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    fields = hf_transformer_fields(Qwen3MoeConfig(**SMALL, **EXPERTS), settings)
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"]) == ("aux_loss", 0.01)
    assert fields["moe_z_loss_coeff"] == 0.001


@pytest.mark.parametrize(
    ("hf_config", "fragment"),
    [
        (Qwen3MoeConfig(**SMALL, **EXPERTS, mlp_only_layers=[0]), "mlp_only_layers=[0], decoder_sparse_step=1"),
        (Qwen2MoeConfig(**SMALL, **EXPERTS, decoder_sparse_step=2), "mlp_only_layers=[], decoder_sparse_step=2"),
        (Qwen3MoeConfig(**SMALL, num_experts=2, num_experts_per_tok=3), "num_experts_per_tok=3"),
    ],
)
def test_unbuildable_moe_configs_are_refused_naming_the_key(hf_config, fragment):
    with pytest.raises(ValueError, match="use a checkpoint with|fix the checkpoint") as error:
        check_hf_config(hf_config)
    assert fragment in str(error.value)


@pytest.mark.parametrize(
    ("hf_config", "settings", "fragment"),
    [
        (Qwen3MoeConfig(**SMALL, **EXPERTS), dict(ep_size=3), "parallel.ep_size=3 must divide the 8 experts"),
        (Qwen3MoeConfig(**SMALL, **EXPERTS), dict(tp_size=2), "needs parallel.sequence_parallel=true"),
        (LlamaConfig(**SMALL), dict(ep_size=2), "parallel.ep_size=2 but model_type='llama' is a dense model"),
    ],
)
def test_expert_layouts_megatron_cannot_form_are_refused_at_load(hf_config, settings, fragment):
    with pytest.raises(ValueError, match="layout does not divide") as error:
        _fields(hf_config, **settings)
    assert fragment in str(error.value)
    assert _fields(hf_config, **{**settings, "ep_size": 1, "tp_size": 1})  # the fix builds


def test_validate_checks_the_expert_layout_before_any_process_starts(tmp_path):
    from gtpo_megatron.megatron_adapter.validation import validate_config

    Qwen3MoeConfig(**SMALL, **EXPERTS).save_pretrained(tmp_path)
    base = [f"model={tmp_path}", "output_dir=unused", "rollout.max_tokens=64"]
    validate_config(load_config(None, [*base, "parallel.ep_size=2"]), 2, check_registries=False)
    for overrides, world, fragment in (
        (["parallel.ep_size=3"], 6, "parallel.ep_size=3 must divide the 8 experts"),
        (["parallel.ep_size=4", "parallel.pp_size=2"], 4, "parallel.ep_size=4 must divide the 2 ranks of a pipeline"),
        (["parallel.tp_size=2"], 2, "needs parallel.sequence_parallel=true"),
    ):
        with pytest.raises(ValueError, match="layout does not divide") as error:
            validate_config(load_config(None, [*base, *overrides]), world, check_registries=False)
        assert fragment in str(error.value)


def _geometry(hf_config, **fields) -> hc.ModelGeometry:
    geometry = hc.ModelGeometry.from_hf(hf_config, padded_vocab_size=1024, tp_size=1)
    return dataclasses.replace(geometry, **fields)


def test_expert_names_are_global_and_map_to_the_hf_names():
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert hc.global_param_name(local, 2, 4) == "decoder.layers.3.mlp.experts.local_experts.4.linear_fc1.weight"
    grouped = "decoder.layers.0.mlp.experts.linear_fc2.weight1"  # Transformer Engine's grouped experts
    assert hc.global_param_name(grouped, 0, 6) == "decoder.layers.0.mlp.experts.linear_fc2.weight7"
    assert hc.expert_index("decoder.layers.0.mlp.router.weight") == -1
    assert hc.global_param_name("decoder.layers.0.mlp.router.weight", 1, 4) == "decoder.layers.1.mlp.router.weight"
    mixtral = _geometry(MixtralConfig(**SMALL, num_local_experts=8))
    fc1 = hc.param_mapping("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", mixtral)
    expert = "model.layers.3.block_sparse_moe.experts.5"
    assert fc1 == hc.ParamMapping(hc.EXPERT_FC1, (f"{expert}.w1.weight", f"{expert}.w3.weight"))
    fc2 = hc.param_mapping("decoder.layers.3.mlp.experts.linear_fc2.weight5", mixtral)
    assert fc2 == hc.ParamMapping(hc.EXPERT, (f"{expert}.w2.weight",))
    router = hc.param_mapping("decoder.layers.0.mlp.router.weight", mixtral)
    assert router == hc.ParamMapping(hc.REPLICATED, ("model.layers.0.block_sparse_moe.gate.weight",))


def test_shared_expert_names_and_what_a_dense_geometry_refuses():
    qwen2 = _geometry(Qwen2MoeConfig(**SMALL, **EXPERTS, shared_expert_intermediate_size=96))
    gate = hc.param_mapping("decoder.layers.0.mlp.shared_experts.gate_weight", qwen2)
    assert gate == hc.ParamMapping(hc.REPLICATED, ("model.layers.0.mlp.shared_expert_gate.weight",))
    fc1 = hc.param_mapping("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", qwen2)
    assert fc1.kind == hc.FC1 and fc1.hf_names[1] == "model.layers.0.mlp.shared_expert.up_proj.weight"
    qwen3 = _geometry(Qwen3MoeConfig(**SMALL, **EXPERTS))  # no shared expert: its names are unknown
    with pytest.raises(ValueError, match="has no Hugging Face mapping"):
        hc.param_mapping("decoder.layers.0.mlp.shared_experts.gate_weight", qwen3)
    dense = _geometry(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="has no Hugging Face mapping"):
        hc.param_mapping("decoder.layers.0.mlp.router.weight", dense)


@pytest.mark.parametrize(
    ("hf_config", "overrides", "fragment"),
    [
        (Qwen3MoeConfig(**SMALL, **EXPERTS, mlp_only_layers=[0]), [], "mlp_only_layers=[0]"),
        (Qwen3MoeConfig(**{**EXPERTS, **SMALL, "num_experts_per_tok": 16}), [], "num_experts_per_tok=16"),
        (
            MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2, sliding_window=64),
            ["optim.max_tokens_per_micro_batch=4000", "optim.packing=true"],
            "optim.packing=true with a sliding-window model",
        ),
    ],
)
def test_load_time_refusals_come_with_the_config_check(tmp_path, hf_config, overrides, fragment):
    """``validate_config`` (the job's first check, before any engine or model is started) runs the load-time
    refusals on a local model's config.json, so a bad checkpoint fails before torchrun has built anything."""
    from gtpo_megatron.megatron_adapter.validation import validate_config

    hf_config.save_pretrained(tmp_path)
    cfg = load_config(None, [f"model={tmp_path}", "output_dir=unused", "rollout.max_tokens=64", *overrides])
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        validate_config(cfg, 2)
