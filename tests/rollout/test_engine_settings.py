"""``rollout/engine_settings.py``: the training engines' vLLM settings from the config, and the refusals."""

from __future__ import annotations

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.rollout.engine_settings import EngineSettings, engine_settings

BASE = ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused"]


def test_the_training_engines_settings_come_from_the_rollout_section():
    cfg = load_config(None, [*BASE, "rollout.max_prompt_len=100", "rollout.max_tokens=28", "rollout.num_prompts=3",
                             "algorithm.group_size=4", "rollout.cpu_kv_cache_gib=1.5", "rollout.seed=9",
                             "rollout.gpu_memory_utilization=0.3", "logging.verbose=true"])  # fmt: skip
    settings = engine_settings(cfg, accelerator=True)
    assert settings == EngineSettings(
        dtype=cfg.engine_dtype, max_model_len=128, gpu_memory_utilization=0.3, cpu_kvcache_space_gib=2,
        tensor_parallel_size=cfg.rollout.engine_tp_size, seed=9, enable_sleep_mode=True, max_num_seqs=16,
        verbose=True, load_format="auto", routing_replay=False,
    )  # fmt: skip
    assert engine_settings(cfg, accelerator=False).enable_sleep_mode is False  # CPU engines never sleep
    separate = engine_settings(load_config(None, [*BASE, "rollout.placement=separate", "rollout.num_prompts=8",
                                                  "algorithm.group_size=8"]), accelerator=True)  # fmt: skip
    assert not separate.enable_sleep_mode and separate.max_num_seqs == 64


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "fp8"}, "dtype='fp8' is not supported"),
        ({"load_format": "pt"}, "load_format='pt' is not supported"),
        ({"cpu_kvcache_space_gib": 0}, "cpu_kvcache_space_gib=0 must be > 0 GiB"),
    ],
)
def test_unknown_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineSettings(**fields)
