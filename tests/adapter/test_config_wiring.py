"""Every field of the ``model``, ``parallel`` and ``optim`` sections reaches what Megatron is built with.

One run config sets EVERY field of the three sections to a non-default value; the Megatron ``TransformerConfig``,
the DDP config, the optimizer config and the LR schedule's arguments are built from it by the same pure functions
``MegatronPolicy.from_pretrained`` calls, and each field is looked up where it must arrive. The fields are enumerated
from the section dataclasses, so a new field fails ``test_config_wiring_every_field_is_wired_or_allowed`` until it is
wired (an entry in ``ARRIVALS``) or allow-listed with a reason (``NOT_MEGATRON``), and
``test_config_wiring_the_run_config_sets_every_field`` until the run config below gives it a non-default value.
``gtpo-plan`` reads the same ``PolicySettings`` (``test_config_wiring_plan_reports_what_megatron_is_built_with``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from gtpo_megatron.config import (
    AlgorithmConfig,
    GTPOConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    TrainerConfig,
)
from gtpo_megatron.megatron_adapter.model import (
    hf_transformer_fields,
    settings_transformer_fields,
    transformer_config_from_hf,
)
from gtpo_megatron.megatron_adapter.optimizer import ddp_config, optimizer_config, scheduler_kwargs
from gtpo_megatron.megatron_adapter.settings import OWNED_FIELDS, PolicySettings, policy_settings
from gtpo_megatron.plan.architectures import architecture_from_hf_config
from gtpo_megatron.plan.layout import check_layout
from gtpo_megatron.plan.memory import DTYPE_BYTES
from gtpo_megatron.plan_cli import training_shape

SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig}
NOT_MEGATRON = {
    "model.name_or_path": "the HF folder: its config.json feeds hf_transformer_fields (checked here through the "
    "head padding), its weights hf_loading.load_hf_weights (tests/distributed/test_megatron_parity.py)",
    "model.megatron_checkpoint": "the starting weights and their vocabulary rows: policy._load_initial_weights and "
    "_padded_vocab read it (tests/plugin/test_megatron_checkpoint.py starts a run from one)",
    "model.fp32_output_layer": "not a TransformerConfig field: policy._build_stage hands it to "
    "model.build_gpt_model, which swaps the output layer's forward (tests/distributed/test_fused_objective.py checks "
    "the built policy and reference)",
    "model.lora": "not a TransformerConfig field: policy._attach_lora adds the adapters after the base weights load "
    "(tests/distributed/test_lora_parity.py checks the built policy)",
    "model.layer_spec": "not a TransformerConfig field: model.layer_spec_backend resolves it and policy._build_stage "
    "builds that spec (tests/config/test_lora_config.py checks the choice)",
    "parallel.cp_size": "only 1 is accepted (ParallelConfig refuses more); Megatron's context_parallel_size stays at "
    "its default 1",
    "parallel.backend": "the torch.distributed backend of parallel.groups.init_distributed (train.py); Megatron's "
    "groups are derived from that process group",
}
"""Fields that do not go into a Megatron config, each with where it goes instead."""
LEFT_AT_DEFAULT = {
    "model.megatron_checkpoint": "excludes model.pad_attention_heads (a checkpoint is loaded as written), which this "
    "config needs; it is in NOT_MEGATRON anyway",
    "parallel.cp_size": "any value but 1 is refused (tests/config checks the message)",
    "model.lora": "in NOT_MEGATRON: no Megatron config field; its own tests are tests/config/test_lora_config.py and "
    "tests/distributed/test_lora_parity.py",
}
"""Fields the run config below cannot set to a non-default value, each with the reason."""
# 3 KV groups of 2 heads (head_dim 32): at tp 2 they need model.pad_attention_heads (4 groups, 8 heads); 4 experts
# of which each of the ep_size 2 ranks holds 2
HF_CONFIG = Qwen3MoeConfig(
    vocab_size=1000, hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=3, head_dim=32, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> GTPOConfig:
    """A run config whose model, parallel and optim sections hold no default value."""
    folder = tmp_path_factory.mktemp("hf")
    HF_CONFIG.save_pretrained(folder)
    return GTPOConfig(
        model=ModelConfig(
            name_or_path=str(folder), params_dtype="float32", make_vocab_size_divisible_by=96, recompute="full",
            pad_attention_heads=True, megatron_overrides={"attention_dropout": 0.125, "bias_dropout_fusion": True},
            fp32_output_layer=False, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, layer_spec="local",
        ),
        parallel=ParallelConfig(
            tp_size=2, pp_size=2, ep_size=2, sequence_parallel=True, use_distributed_optimizer=True, backend="gloo"
        ),
        optim=OptimConfig(
            lr=3e-5, min_lr=1e-6, warmup_steps=3, weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95, clip_grad=0.5,
            micro_batch_size=2, max_tokens_per_micro_batch=2048, packing=True,
        ),
        trainer=TrainerConfig(max_steps=40, seed=11),
        algorithm=AlgorithmConfig(num_updates_per_batch=2, logprob_chunk_size=256),
        rollout=RolloutConfig(num_prompts=4),
        output_dir="unused",
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(cfg: GTPOConfig) -> SimpleNamespace:
    """What ``MegatronPolicy.from_pretrained`` builds Megatron from and with, for ``cfg``."""
    settings = policy_settings(cfg)
    transformer = transformer_config_from_hf(HF_CONFIG, settings)
    return SimpleNamespace(
        settings=settings,
        transformer=transformer,
        ddp=ddp_config(settings),
        optimizer=optimizer_config(settings, params_dtype=transformer.params_dtype),
        scheduler=scheduler_kwargs(settings),
        padded_vocab_size=settings.padded_vocab_size(HF_CONFIG.vocab_size),
    )


ARRIVALS = {
    "model.params_dtype": lambda b: [
        (b.transformer.params_dtype, torch.float32), (b.transformer.pipeline_dtype, torch.float32),
        (b.transformer.bf16, False), (b.optimizer.params_dtype, torch.float32), (b.optimizer.bf16, False)],
    "model.make_vocab_size_divisible_by": lambda b: [(b.padded_vocab_size, 1152)],  # 1000 -> multiple of 96 * 2
    "model.recompute": lambda b: [
        (b.transformer.recompute_granularity, "full"), (b.transformer.recompute_method, "uniform"),
        (b.transformer.recompute_num_layers, 1)],
    "model.pad_attention_heads": lambda b: [
        (b.transformer.num_query_groups, 4), (b.transformer.num_attention_heads, 8)],
    "model.megatron_overrides": lambda b: [
        (b.transformer.attention_dropout, 0.125), (b.transformer.bias_dropout_fusion, True)],
    "parallel.tp_size": lambda b: [(b.transformer.tensor_model_parallel_size, 2)],
    "parallel.pp_size": lambda b: [(b.transformer.pipeline_model_parallel_size, 2)],
    "parallel.ep_size": lambda b: [(b.transformer.expert_model_parallel_size, 2)],
    "model.moe_aux_loss_coeff": lambda b: [
        (b.transformer.moe_aux_loss_coeff, 0.01), (b.transformer.moe_router_load_balancing_type, "aux_loss")],
    "model.moe_z_loss_coeff": lambda b: [(b.transformer.moe_z_loss_coeff, 0.001)],
    "parallel.sequence_parallel": lambda b: [(b.transformer.sequence_parallel, True)],
    "parallel.use_distributed_optimizer": lambda b: [
        (b.ddp.use_distributed_optimizer, True), (b.optimizer.use_distributed_optimizer, True)],
    "optim.lr": lambda b: [(b.optimizer.lr, 3e-5), (b.scheduler["max_lr"], 3e-5)],
    "optim.min_lr": lambda b: [
        (b.optimizer.min_lr, 1e-6), (b.scheduler["min_lr"], 1e-6), (b.scheduler["lr_decay_style"], "cosine")],
    "optim.warmup_steps": lambda b: [(b.scheduler["lr_warmup_steps"], 3), (b.scheduler["init_lr"], 3e-5 / 4)],
    "optim.weight_decay": lambda b: [
        (b.optimizer.weight_decay, 0.01), (b.scheduler["start_wd"], 0.01), (b.scheduler["end_wd"], 0.01)],
    "optim.adam_beta1": lambda b: [(b.optimizer.adam_beta1, 0.8)],
    "optim.adam_beta2": lambda b: [(b.optimizer.adam_beta2, 0.95)],
    "optim.clip_grad": lambda b: [(b.optimizer.clip_grad, 0.5)],
    # the policy cuts micro-batches of this many rows and hands the number to Megatron's schedule
    "optim.micro_batch_size": lambda b: [(b.settings.micro_batch_size, 2)],
    # the policy bins sequences under the budget; at pp_size 2 the stages exchange each micro-batch's shape
    "optim.max_tokens_per_micro_batch": lambda b: [
        (b.settings.token_budget.max_tokens, 2048), (b.transformer.variable_seq_lengths, True),
        (b.transformer.moe_token_dispatcher_type, "alltoall")],
    "optim.packing": lambda b: [(b.settings.token_budget.packing, True)],
}  # fmt: skip
"""Where each field must arrive: ``field -> built -> [(arrived value, expected value), ...]``."""


def _section_fields() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def test_config_wiring_every_field_is_wired_or_allowed():
    listed = set(ARRIVALS) | set(NOT_MEGATRON)
    missing = [name for name in _section_fields() if name not in listed]
    assert missing == [], (
        f"wire these fields into a Megatron config (and ARRIVALS) or add them to NOT_MEGATRON: {missing}"
    )
    assert set(ARRIVALS).isdisjoint(NOT_MEGATRON) and listed <= set(_section_fields())


def test_config_wiring_the_run_config_sets_every_field(cfg: GTPOConfig):
    defaults = []
    for name in _section_fields():
        section, field_name = name.split(".")
        spec = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == field_name)
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        if getattr(getattr(cfg, section), field_name) == default and name not in LEFT_AT_DEFAULT:
            defaults.append(name)
    assert defaults == [], f"give these fields a non-default value in this test's run config: {defaults}"


@pytest.mark.parametrize("name", sorted(ARRIVALS))
def test_config_wiring_field_arrives(name: str, built: SimpleNamespace):
    for arrived, expected in ARRIVALS[name](built):
        assert arrived == expected, f"{name}: Megatron got {arrived!r}, the config says {expected!r}"


def test_config_wiring_schedule_and_the_policy_knobs(built: SimpleNamespace):
    """The fields of other sections the settings carry: the schedule's length, the chunk size, the seed."""
    assert built.scheduler["lr_decay_steps"] == 80  # trainer.max_steps * algorithm.num_updates_per_batch
    assert (built.settings.logprob_chunk_size, built.settings.seed) == (256, 11)


def test_config_wiring_plan_reports_what_megatron_is_built_with(cfg: GTPOConfig, built: SimpleNamespace):
    arch = architecture_from_hf_config(HF_CONFIG.to_dict(), name="test")
    layout = check_layout(
        arch, world_size=8, tp_size=built.settings.tp_size, pp_size=built.settings.pp_size, engine_tp_size=1,
        placement="colocated", num_prompts=4, group_size=8, micro_batch_size=built.settings.micro_batch_size,
        make_vocab_size_divisible_by=built.settings.model.make_vocab_size_divisible_by,
        pad_attention_heads=built.settings.model.pad_attention_heads, ep_size=built.settings.ep_size,
        sequence_parallel=built.settings.sequence_parallel,
    )  # fmt: skip
    shape = training_shape(built.settings, layout, seq_length=2012)
    transformer = built.transformer
    assert (shape.tp_size, shape.pp_size) == (
        transformer.tensor_model_parallel_size, transformer.pipeline_model_parallel_size)  # fmt: skip
    assert shape.sequence_parallel == transformer.sequence_parallel
    assert shape.recompute == (transformer.recompute_granularity or "none")
    assert shape.distributed_optimizer == built.ddp.use_distributed_optimizer
    assert shape.param_bytes == transformer.params_dtype.itemsize == DTYPE_BYTES[cfg.model.params_dtype]
    # under a token budget the plan's micro-batch is the budget, not micro_batch_size rows
    assert (shape.micro_batch_tokens, shape.logprob_chunk_size) == (built.settings.token_budget.max_tokens, 256)
    assert layout.padded_vocab_size == built.padded_vocab_size


def test_config_wiring_owned_fields_are_exactly_what_the_builders_set():
    settings = PolicySettings(model=ModelConfig(name_or_path="x"), parallel=ParallelConfig(tp_size=2, pp_size=2),
                              optim=OptimConfig(max_tokens_per_micro_batch=64))  # fmt: skip
    sizes = {k: getattr(HF_CONFIG, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    # layers 2 and 3 windowed, a shared expert with its gate
    windowed = Qwen2MoeConfig(**sizes, num_attention_heads=6, num_key_value_heads=3, use_sliding_window=True,
                              sliding_window=16, max_window_layers=2, num_experts=4, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64)  # fmt: skip
    derived = set(settings_transformer_fields(settings))
    one_tp = dataclasses.replace(settings, parallel=ParallelConfig(tp_size=1, pp_size=2))
    for hf in (HF_CONFIG, windowed):
        derived |= set(hf_transformer_fields(hf, one_tp))
    assert derived == set(OWNED_FIELDS)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"sequence_parallel": True}, "sequence_parallel (set by parallel.sequence_parallel)"),
        ({"bf16": True, "num_layers": 3}, "bf16 (set by model.params_dtype), num_layers (set by the model's config"),
        ({"recompute_num_layers": 2}, "recompute_num_layers (set by model.recompute)"),
        ({"calculate_per_token_loss": True}, "the loss normalisation contract"),
        ({"moe_layer_freq": 2}, "moe_layer_freq (set by the model's config"),  # routing HF and vLLM do not have
        ({"moe_input_jitter_eps": 0.01}, "moe_input_jitter_eps (set by the model's config"),
    ],
)
def test_config_wiring_overrides_of_owned_fields_are_refused(cfg: GTPOConfig, overrides, fragment):
    model = dataclasses.replace(cfg.model, megatron_overrides=overrides)
    with pytest.raises(ValueError, match="model.megatron_overrides sets") as error:
        policy_settings(dataclasses.replace(cfg, model=model))
    assert fragment in str(error.value)


def test_config_wiring_policy_settings_refusals(cfg: GTPOConfig):
    with pytest.raises(ValueError, match=r"model.params_dtype='float16'.*set model.params_dtype=bfloat16"):
        policy_settings(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, params_dtype="float16")))
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel=True: needs parallel.tp_size > 1"):
        ParallelConfig(tp_size=1, pp_size=2, sequence_parallel=True)  # the section's rule, not re-checked here
