"""``rollout.routing_replay``: off by default, and refused where it cannot run (dense model, missing primitives)."""

from __future__ import annotations

import inspect

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.megatron_adapter.settings import policy_settings

BASE = ["output_dir=/tmp/run"]
DENSE = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
MOE = {**DENSE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_routing_replay_is_off_by_default_and_reaches_the_policy_settings():
    cfg = load_config(None, ["model=builtin:tiny-qwen3-moe", *BASE])
    assert cfg.rollout.routing_replay == "off" and not policy_settings(cfg).routing_replay
    on = load_config(None, ["model=builtin:tiny-qwen3-moe", "rollout.routing_replay=rollout", *BASE])
    assert policy_settings(on).routing_replay
    on.validate(1, hf_config=MOE)


def test_routing_replay_refuses_a_dense_model_and_unknown_values():
    cfg = load_config(None, ["model=builtin:tiny-qwen2", "rollout.routing_replay=rollout", *BASE])
    with pytest.raises(ValueError, match=r"rollout.routing_replay='rollout': .* is a dense model .*routing_replay=off"):
        cfg.validate(1, hf_config=DENSE)
    with pytest.raises(ValueError, match="routing_replay"):
        load_config(None, ["model=builtin:tiny-qwen3-moe", "rollout.routing_replay=engine", *BASE])


def test_load_time_check_refuses_a_dense_model_and_a_megatron_without_the_replay_hook(monkeypatch):
    from megatron.core.transformer.moe import moe_utils
    from transformers import Qwen2Config, Qwen3MoeConfig

    from gtpo_megatron.megatron_adapter.moe.routing_replay import check_replay_supported

    moe = Qwen3MoeConfig(**{k: v for k, v in MOE.items() if k != "model_type"})
    check_replay_supported(moe)
    with pytest.raises(ValueError, match="model_type='qwen2' is a dense model"):
        check_replay_supported(Qwen2Config(**{k: v for k, v in DENSE.items() if k != "model_type"}))

    def without_hook(logits, topk, use_pre_softmax=False):  # the signature before megatron-core 0.16
        raise AssertionError("not called")

    assert "router_replay" in inspect.signature(moe_utils.topk_routing_with_score_function).parameters
    monkeypatch.setattr(moe_utils, "topk_routing_with_score_function", without_hook)
    with pytest.raises(RuntimeError, match=r"install megatron-core>=0.16.1 or set rollout.routing_replay=off"):
        check_replay_supported(moe)


ASYNC_TIS = ["rollout.placement=separate", "rollout.mode=async", "algorithm.off_policy_correction=tis",
             "algorithm.loss_temperature=sampling", "rollout.routing_replay=rollout"]  # fmt: skip


@pytest.mark.parametrize(
    "changed",
    [[], ["algorithm.off_policy_correction=mis"], ["rollout.mode=sync"], ["algorithm.off_policy_correction=none"],
     ["rollout.routing_replay=off"]],
)  # fmt: skip
def test_routing_replay_with_async_importance_weights_warns(changed: list[str], caplog):
    from gtpo_megatron.megatron_adapter.validation import validate_config

    cfg = load_config(None, ["model=builtin:tiny-qwen3-moe", *BASE, *ASYNC_TIS, *changed])
    with caplog.at_level("WARNING", logger="gtpo_megatron.megatron_adapter.validation"):
        validate_config(cfg, 1, check_registries=False)
    warned = [r.getMessage() for r in caplog.records if "routing drift" in r.getMessage()]
    if changed in ([], ["algorithm.off_policy_correction=mis"]):
        correction = cfg.algorithm.off_policy_correction
        assert len(warned) == 1 and f"algorithm.off_policy_correction={correction!r}" in warned[0], warned
        assert "rollout.routing_replay='rollout' with rollout.mode='async'" in warned[0]
    else:
        assert not warned
