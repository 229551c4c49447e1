"""``gtpo-plan`` for mixture-of-experts models: parameter counts, expert sharding, the layout rules and the recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gtpo_megatron.plan.architectures import KNOWN_ARCHITECTURES, Architecture, architecture_from_hf_config
from gtpo_megatron.plan.memory import optimizer_bytes, stage_expert_params, stage_params
from gtpo_megatron.plan_cli import run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MOE_RECIPES = {
    "qwen3-30b-a3b_math_gtpo_8gpu": 8,
    "qwen3-30b-a3b_math_gtpo_lora_8gpu": 8,
    "qwen3-30b-a3b_math_gtpo_32gpu": 32,
    "qwen3-235b-a22b_math_gtpo_64gpu": 64,
    "qwen3-235b-a22b_math_gtpo_128gpu": 128,
}
# h 8, 2 layers, 4 heads of 2 (2 KV heads), 4 experts of width 3, top-2, a shared expert of width 5, vocab 10
TINY = Architecture(
    name="tiny-moe", num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=4, num_query_groups=2,
    head_dim=2, vocab_size=10, tied_embeddings=False, num_experts=4, expert_ffn_size=3, top_k=2,
    shared_expert_ffn_size=5,
)  # fmt: skip


def test_published_totals_and_active_parameters():
    # Qwen's model cards: 30.5B total / 3.3B activated; 235B total / 22B activated
    assert KNOWN_ARCHITECTURES["Qwen3-30B-A3B"].total_params() / 1e9 == pytest.approx(30.53, abs=0.01)
    assert KNOWN_ARCHITECTURES["Qwen3-30B-A3B"].active_params() / 1e9 == pytest.approx(3.35, abs=0.01)
    assert KNOWN_ARCHITECTURES["Qwen3-235B-A22B"].total_params() / 1e9 == pytest.approx(235.09, abs=0.01)
    assert KNOWN_ARCHITECTURES["Qwen3-235B-A22B"].active_params() / 1e9 == pytest.approx(22.19, abs=0.01)
    dense = KNOWN_ARCHITECTURES["Qwen3-32B"]
    assert dense.active_params() == dense.total_params()


def test_stage_parameters_by_hand():
    # a layer: attention 8*(8+4+4) + 8*8 = 192; router 4*8 = 32; experts 4 * 3*8*3 = 288; shared 3*8*5 + gate 8 = 128;
    # norms 16 -> 656
    assert TINY.layer_params() == 656
    assert TINY.active_params() == 2 * (656 - 2 * 72) + 8 + 2 * 80
    # tp 2, ep 2, one stage: per layer sharded (192 + 120) / 2 + replicated (16 + 32 + 8) + 2 experts of 72
    per_layer = 312 // 2 + 56 + 2 * 72
    embeddings = 2 * (10 * 8 // 2) + 8  # input and output layer (tp 2), final norm
    assert (
        stage_params(TINY, tp_size=2, pp_size=1, padded_vocab_size=10, stage=0, ep_size=2) == 2 * per_layer + embeddings
    )
    assert stage_expert_params(TINY, pp_size=1, ep_size=2) == 2 * 2 * 72


def test_distributed_optimizer_shards_experts_over_their_data_parallel_group():
    # 100 params of which 40 expert: dense 60 * 12 / dp 4, experts 40 * 12 / edp 2
    assert optimizer_bytes(100, param_bytes=2, dp_size=4, distributed_optimizer=True, expert_params=40,
                           expert_dp_size=2) == 60 * 12 // 4 + 40 * 12 // 2  # fmt: skip
    assert optimizer_bytes(100, param_bytes=2, dp_size=4, distributed_optimizer=False, expert_params=40) == 1200


def test_moe_config_json_is_read():
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
            "num_attention_heads": 4, "vocab_size": 10, "num_experts": 4, "moe_intermediate_size": 3,
            "num_experts_per_tok": 2}  # fmt: skip
    arch = architecture_from_hf_config(qwen, name="q")
    assert (arch.num_experts, arch.expert_ffn_size, arch.top_k, arch.qk_norm) == (4, 3, 2, True)
    mixtral = {**qwen, "model_type": "mixtral", "num_local_experts": 8, "num_experts": None}
    assert architecture_from_hf_config(mixtral, name="m").expert_ffn_size == 16  # Mixtral: intermediate_size


@pytest.mark.parametrize(("stem", "gpus"), sorted(MOE_RECIPES.items()))
def test_moe_recipes_fit_and_report_their_experts(stem: str, gpus: int):
    status, text = run(["--config", str(CONFIGS / f"{stem}.yaml"), "--gpus", str(gpus), "--gpu-mem", "80"])
    assert status == 0, text
    assert "experts: 128 a layer, 8 active" in text and "fits:" in text


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["parallel.ep_size=3"], "parallel.ep_size=3 must divide the 128 experts of Qwen3-30B-A3B"),
        (["parallel.tp_size=2", "parallel.sequence_parallel=false"], "needs parallel.sequence_parallel=true"),
        (["parallel.ep_size=64"], "parallel.ep_size=64 must divide the 32 ranks of a pipeline stage"),
        (["model.recompute=none"], "training phase needs"),  # an MoE layer keeps k = 8 expert rows a token
    ],
)
def test_moe_layouts_that_do_not_divide_or_fit_exit_2(overrides, fragment):
    recipe = str(CONFIGS / "qwen3-30b-a3b_math_gtpo_32gpu.yaml")
    status, text = run(["--config", recipe, "--gpus", "32", "--gpu-mem", "80", *overrides])
    assert status == 2 and fragment in text, text


def test_the_engines_expert_layout_is_reported():
    """Engines keep all 128 experts a layer, split by engine tp 8 (bf16: 48 x 128 x 3 x 2048 x 768 x 2 / 8 bytes)."""
    recipe = str(CONFIGS / "qwen3-30b-a3b_math_gtpo_32gpu.yaml")
    status, text = run(["--config", recipe, "--gpus", "32", "--gpu-mem", "80"])
    assert status == 0 and "engines: all 128 a layer, each split 8 ways by engine tp, 6.75 GiB" in text, text


@pytest.mark.parametrize(
    ("config", "model_type"),
    [
        ({"n_routed_experts": 256, "moe_intermediate_size": 2048}, "deepseek_v3"),  # MLA: not a dense model
        ({"num_experts": 64, "intermediate_size": 1024}, "olmoe"),  # no moe_intermediate_size: no KeyError
    ],
)
def test_experts_of_an_unbuilt_type_are_refused_by_name(config, model_type):
    dense_fields = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 4,
                    "vocab_size": 10, "num_experts_per_tok": 8}  # fmt: skip
    with pytest.raises(ValueError, match=rf"model_type='{model_type}' is a mixture of experts .*'qwen3_moe'"):
        architecture_from_hf_config({**dense_fields, **config, "model_type": model_type}, name="m")


def test_lora_recipe_syncs_only_the_adapters():
    """Qwen3-30B-A3B with the paper's rank-128 adapters on attention (experts refused: tests/config/test_lora_config):
    ``48 * 128 * (2048 + 4096 + 2048 + 512 + 2048 + 512 + 4096 + 2048)`` bf16 adapter bytes a sync, not 61 GB."""
    recipe = str(CONFIGS / "qwen3-30b-a3b_math_gtpo_lora_8gpu.yaml")
    status, text = run(["--config", recipe, "--gpus", "8", "--gpu-mem", "80"])
    assert status == 0 and "rollout.lora_sync=adapter" in text and "0.21 GB (bfloat16) per sync" in text, text


@pytest.mark.parametrize("bad", [5, 8])
def test_suggested_ep_sizes_pass_both_expert_parallel_rules(bad):
    """12 ranks (tp 2: dp 6) and 128 experts: the suggestions are [1, 2, 4], and each of them is accepted."""
    recipe = str(CONFIGS / "qwen3-30b-a3b_math_gtpo_8gpu.yaml")
    fixed = ["--config", recipe, "--gpus", "12", "--gpu-mem", "80", "rollout.num_prompts=12"]
    status, text = run([*fixed, f"parallel.ep_size={bad}"])
    lines = [line for line in text.splitlines() if f"parallel.ep_size={bad} must divide" in line]
    assert status == 2 and lines and all(line.endswith("use one of [1, 2, 4]") for line in lines), text
    for ep in (1, 2, 4):
        status, text = run([*fixed, f"parallel.ep_size={ep}"])
        assert "layout does not divide" not in text and f"ep {ep}:" in text, text
