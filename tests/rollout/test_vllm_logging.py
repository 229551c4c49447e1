"""The quiet vLLM console's filter and config (``rollout/vllm_logging.py``) without vLLM; the real engine's console
is ``tests/integration/test_vllm_console.py``."""

from __future__ import annotations

import importlib
import json
import logging

from gtpo_megatron.rollout import vllm_logging


def _record(msg, *args):
    return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, args, None)


def test_harmless_records_are_dropped_and_the_tied_head_only_when_tied():
    untied, tied = vllm_logging.HarmlessVllmRecords(), vllm_logging.HarmlessVllmRecords(tied_embeddings=True)
    dtype = _record("Attempted to load weight %s with dtype %s into parameter with dtype %s", "w", "f32", "bf16")
    head = _record("%s: Failed to load weights", "ParallelLMHead")
    other = _record("%s: Failed to load weights", "QKVParallelLinear")  # a real missing weight: always shown
    assert not untied.filter(dtype) and not tied.filter(dtype)
    assert untied.filter(head) and not tied.filter(head)
    assert untied.filter(other) and tied.filter(other)
    assert tied.filter(_record("CPU KV cache is too small"))


def test_child_environment_points_at_a_config_with_the_filter(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    env = vllm_logging.child_log_environment(tmp_path, tied_embeddings=True)
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert env["PYTHONWARNINGS"].startswith("error::DeprecationWarning,ignore:`torch.distributed.reduce_op`")
    config = json.loads((tmp_path / "vllm_logging.json").read_text())
    assert env["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "vllm_logging.json")
    factory = config["filters"]["harmless"]
    module, name = factory["()"].rsplit(".", 1)
    built = getattr(importlib.import_module(module), name)(tied_embeddings=factory["tied_embeddings"])
    assert not built.filter(_record("%s: Failed to load weights", "ParallelLMHead"))
    assert config["handlers"]["vllm"]["filters"] == ["harmless"] and config["loggers"]["vllm"]["level"] == "WARNING"


def test_ties_embeddings_reads_the_config(tmp_path):
    assert vllm_logging.ties_embeddings(str(tmp_path)) is False  # no config.json: cannot tell
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert vllm_logging.ties_embeddings(str(tmp_path)) is True
