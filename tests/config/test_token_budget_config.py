"""Token-budget, packing and context-parallel settings: every bad value refused before the first step, by name."""

from __future__ import annotations

import pytest

from gtpo_megatron.config import ModelConfig, OptimConfig, load_config
from gtpo_megatron.megatron_adapter.settings import PolicySettings, policy_settings
from gtpo_megatron.megatron_adapter.validation import validate_config
from gtpo_megatron.plan.micro_batches import TokenBudget

BASE = ["model=builtin:tiny-qwen2", "output_dir=/tmp/run", "rollout.max_prompt_len=100", "rollout.max_tokens=400"]


@pytest.mark.parametrize(
    "override, fragment, fix",
    [
        ("optim.max_tokens_per_micro_batch=0", "optim.max_tokens_per_micro_batch=0: must be >= 1 or null",
         "use at least rollout.max_prompt_len + rollout.max_tokens"),
        ("parallel.cp_size=2", "parallel.cp_size=2: context parallelism needs Transformer Engine's attention",
         "set parallel.cp_size=1"),
    ],
)  # fmt: skip
def test_token_budget_config_field_errors(override: str, fragment: str, fix: str):
    with pytest.raises(ValueError) as error:
        load_config(None, [*BASE, override])
    assert fragment in str(error.value) and f"; {fix}" in str(error.value)


@pytest.mark.parametrize(
    "budget, fragment",
    [
        (64, "is smaller than the longest prompt (rollout.max_prompt_len=100)"),
        (499, "is smaller than the longest sequence (rollout.max_prompt_len + rollout.max_tokens = 500)"),
    ],
)
def test_token_budget_config_budget_must_hold_the_longest_sequence(budget: int, fragment: str):
    cfg = load_config(None, [*BASE, f"optim.max_tokens_per_micro_batch={budget}"])
    with pytest.raises(ValueError, match=f"optim.max_tokens_per_micro_batch={budget}") as error:
        validate_config(cfg, 1, check_registries=False)
    assert fragment in str(error.value) and "raise it to at least" in str(error.value)


def test_token_budget_config_frees_the_micro_batch_size_rule():
    # 8 x 4 rows over 2 ranks: 16 a rank, which micro_batch_size=3 does not divide; a budget forms its own bins
    rows = ["rollout.num_prompts=8", "algorithm.group_size=4", "optim.micro_batch_size=3"]
    with pytest.raises(ValueError, match="optim.micro_batch_size=3 must divide"):
        validate_config(load_config(None, [*BASE, *rows]), 2, check_registries=False)
    cfg = load_config(None, [*BASE, *rows, "optim.max_tokens_per_micro_batch=1000", "optim.packing=true"])
    validate_config(cfg, 2, check_registries=False)
    assert policy_settings(cfg).token_budget == TokenBudget(max_tokens=1000, packing=True)


def test_token_budget_config_packing_alone_takes_micro_batch_size_full_length_rows():
    # 3 rows x (prompt 100 + response 400) = 1500 tokens; an explicit budget wins; without packing: rows
    cfg = load_config(None, [*BASE, "optim.micro_batch_size=3", "optim.packing=true"])
    validate_config(cfg, 1, check_registries=False)
    assert cfg.optim.max_tokens_per_micro_batch is None and cfg.max_tokens_per_micro_batch == 1500
    assert policy_settings(cfg).token_budget == TokenBudget(max_tokens=1500, packing=True)
    explicit = load_config(None, [*BASE, "optim.micro_batch_size=3", "optim.packing=true",
                                  "optim.max_tokens_per_micro_batch=700"])  # fmt: skip
    assert explicit.max_tokens_per_micro_batch == 700
    assert load_config(None, [*BASE, "optim.micro_batch_size=3"]).max_tokens_per_micro_batch is None


def test_token_budget_config_packing_refuses_sliding_windows():
    from transformers import Qwen2Config

    from gtpo_megatron.megatron_adapter.model import transformer_config_from_hf

    windowed = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1,
    )  # fmt: skip
    model = ModelConfig(name_or_path="unused", params_dtype="float32")
    padded = PolicySettings(model=model, optim=OptimConfig(max_tokens_per_micro_batch=64))
    assert transformer_config_from_hf(windowed, padded).window_size == (15, 0)
    with pytest.raises(ValueError, match=r"optim.packing=true with a sliding-window model \(window_size=\(15, 0\)\)"):
        transformer_config_from_hf(
            windowed, PolicySettings(model=model, optim=OptimConfig(max_tokens_per_micro_batch=64, packing=True))
        )
