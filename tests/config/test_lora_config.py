"""``model.lora`` and ``rollout.lora_sync``: defaults, the peft names, and each refusal naming field, value and fix."""

from __future__ import annotations

import pytest

from gtpo_megatron.config import LoRAConfig, load_config

BASE = ["output_dir=/tmp/run", "model=builtin:tiny-qwen2"]
DENSE = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_off_by_default_and_all_linear_expands_to_the_seven_projections():
    cfg = load_config(None, BASE)
    assert not cfg.model.lora.enabled and cfg.rollout.lora_sync == "merged"
    lora = load_config(None, [*BASE, "model.lora.rank=128", "model.lora.alpha=128"]).model.lora
    assert lora.enabled and lora.scale == 1.0
    assert lora.projections == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    some = LoRAConfig(rank=8, target_modules=("v_proj", "q_proj"))
    assert some.projections == ("q_proj", "v_proj") and some.scale == 1.0
    assert LoRAConfig(rank=4, alpha=8).scale == 2.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.rank=0", "model.lora.rank=0: must be >= 1 or null; use 128"),
        ("model.lora.alpha=0", "model.lora.alpha=0.0: must be > 0 or null"),
        ("model.lora.dropout=1", "model.lora.dropout=1.0: must be in \\[0, 1\\)"),
        ("model.lora.target_modules=[q_proj,qkv_proj]", "names \\['qkv_proj'\\]; each must be one of .*all-linear"),
        (
            "model.layer_spec=transformer_engine",
            r"model.layer_spec/model.lora.rank=\('transformer_engine', 4\): Transformer Engine fuses the input norm"
            r".*set model.layer_spec=auto \(local with LoRA\) or local",
        ),
    ],
)
def test_bad_section_values_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [*BASE, "model.lora.rank=4", override])


@pytest.mark.parametrize(
    ("overrides", "hf_config", "message"),
    [
        (
            ["model.lora.rank=1024", "rollout.lora_sync=adapter"],
            None,
            "model.lora.rank=1024: is above vLLM's largest max_lora_rank \\(512\\).*use a rank <= 512",
        ),
        (
            ["rollout.lora_sync=adapter", "model.megatron_checkpoint=/ckpt"],
            None,
            "model.megatron_checkpoint='/ckpt': starts the engines with dummy .*model.megatron_checkpoint=null",
        ),
        (
            ["rollout.lora_sync=adapter", "rollout.fault_tolerance=true", "rollout.num_engines=2"],
            None,
            "rollout.fault_tolerance=True: .*set rollout.fault_tolerance=false or set rollout.lora_sync=merged",
        ),
        (
            [
                "rollout.lora_sync=adapter",
                "rollout.partial_rollouts=true",
                "rollout.mode=async",
                "rollout.placement=separate",
                "rollout.weight_sync=files",
                "algorithm.off_policy_correction=tis",
            ],
            None,
            "rollout.partial_rollouts=True: .*set rollout.partial_rollouts=false or set rollout.lora_sync=merged",
        ),
        (["model.lora.rank=null", "rollout.lora_sync=adapter"], None, "model.lora.rank is null"),
        (["model.lora.dropout=0.1", "parallel.tp_size=2"], None, "model.lora.dropout=0.1: .*parallel.tp_size=2"),
        ([], MOE, "model.lora.target_modules=\\('all-linear',\\): targets the MLP .*experts.*\\[q_proj, k_proj"),
    ],
)
def test_cross_section_refusals(overrides, hf_config, message):
    cfg = load_config(None, [*BASE, "model.lora.rank=4", *overrides])
    with pytest.raises(ValueError, match=message):
        cfg.validate(2, hf_config=hf_config)


def test_adapter_sync_passes_and_sizes_the_engines_max_lora_rank():
    from gtpo_megatron.rollout.engine_settings import engine_settings
    from gtpo_megatron.rollout.vllm_lora import engine_max_lora_rank, lora_engine_kwargs

    cfg = load_config(None, [*BASE, "model.lora.rank=4", "rollout.lora_sync=adapter"])
    cfg.validate(1, hf_config=DENSE)
    assert engine_settings(cfg, accelerator=False).max_lora_rank == 4
    assert lora_engine_kwargs(4)["max_lora_rank"] == 8 and engine_max_lora_rank(128) == 128
    assert lora_engine_kwargs(None) == {}
    assert engine_settings(load_config(None, BASE), accelerator=False).max_lora_rank is None


def test_attention_adapters_on_a_moe_model_pass():
    overrides = ["model.lora.rank=4", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    load_config(None, [*BASE, *overrides]).validate(1, hf_config=MOE)


@pytest.mark.parametrize(
    ("overrides", "te_imports", "backend"),
    [
        ([], True, "transformer_engine"),
        ([], False, "local"),
        (["model.lora.rank=4"], True, "local"),  # the adapters need the norm's output, which TE fuses away
        (["model.lora.rank=4"], False, "local"),
        (["model.layer_spec=local"], True, "local"),
        (["model.layer_spec=transformer_engine"], True, "transformer_engine"),
    ],
)
def test_auto_builds_local_layers_with_lora_even_where_transformer_engine_imports(
    monkeypatch, overrides, te_imports, backend
):
    from gtpo_megatron.megatron_adapter import model as model_lib

    monkeypatch.setattr(model_lib, "transformer_engine_available", lambda: te_imports)
    assert model_lib.layer_spec_backend(load_config(None, [*BASE, *overrides]).model) == backend


def test_transformer_engine_asked_for_where_it_does_not_import_is_refused(monkeypatch):
    from gtpo_megatron.megatron_adapter import model as model_lib

    monkeypatch.setattr(model_lib, "transformer_engine_available", lambda: False)
    model = load_config(None, [*BASE, "model.layer_spec=transformer_engine"]).model
    with pytest.raises(ValueError, match=r"model.layer_spec=transformer_engine: .* does not import here; install it"):
        model_lib.layer_spec_backend(model)
