"""SamplingConfig / prompt validation, request seeding and the engines' surfaces; no engine is started."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from gtpo_megatron.rollout import vllm_engine
from gtpo_megatron.rollout.engine import (
    RolloutEngine,
    SamplingConfig,
    check_prompt_indices,
    request_seed,
    validate_prompt_ids,
)
from gtpo_megatron.rollout.vllm_async_engine import AsyncFacade
from gtpo_megatron.rollout.vllm_engine import VLLMEngine


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": "</answer>"}, "stop"),
    ],
)
def test_sampling_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingConfig(**kwargs)


def test_validate_prompt_ids():
    validate_prompt_ids([[1, 2, 3]], max_model_len=8, max_tokens=5)
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_ids([], max_model_len=8, max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        validate_prompt_ids([[1], []], max_model_len=8, max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] has 4 tokens and max_tokens=5.*max_model_len=8"):
        validate_prompt_ids([[1, 2, 3, 4]], max_model_len=8, max_tokens=5)


def test_request_seeds_are_distinct_and_stable():
    """One stream per (call seed, global prompt index, sample index); vLLM's seed + j overlaps are gone."""
    seeds = {request_seed(s, i, j) for s in range(20) for i in range(32) for j in range(16)}
    assert len(seeds) == 20 * 32 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert request_seed(7, 1, 0) != request_seed(7, 0, 1) != request_seed(8, 0, 0)
    assert request_seed(3, 7, 2) == 0x4E17903CF37FDF98  # pinned: a resumed run must sample like the original


def test_prompt_indices():
    assert check_prompt_indices(None, 3) == [0, 1, 2]
    assert check_prompt_indices((4, 5, 7), 3) == [4, 5, 7]
    for bad in ([0, 1], [0, 0, 1], [-1, 0, 1]):
        with pytest.raises(ValueError, match="3 distinct indices >= 0"):
            check_prompt_indices(bad, 3)


def test_vllm_engine_satisfies_protocol_structurally():
    for name in (
        "generate",
        "update_weights",
        "begin_weight_update",
        "load_weight_bucket",
        "finish_weight_update",
        "sleep",
        "wake_up",
        "close",
    ):
        assert callable(getattr(VLLMEngine, name)), name
    assert {"generate", "update_weights", "sleep", "wake_up", "close"} <= set(dir(RolloutEngine))


def _calls_on_the_engine(source: str) -> dict[str, set[str]]:
    """Each method ``source`` calls as ``self._llm.<name>(...)``: the keywords it passes, over all its calls."""
    calls: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        target = node.func if isinstance(node, ast.Call) else None
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self._llm":
            calls.setdefault(target.attr, set()).update(k.arg for k in node.keywords)
    return calls


def _engine_modules() -> set:
    """The package modules defining ``VLLMEngine`` and its bases (the engine's code is split across them)."""
    return {inspect.getmodule(c) for c in VLLMEngine.__mro__ if c.__module__.startswith("gtpo_megatron.")}


def test_every_module_calling_vllm_llm_is_part_of_the_engine():
    """The scan below must see every ``self._llm.<name>(...)`` call: no rollout module outside the engine makes one."""
    rollout = Path(vllm_engine.__file__).parent
    callers = {path.stem for path in rollout.glob("*.py") if _calls_on_the_engine(path.read_text())}
    assert {m.__name__.rsplit(".", 1)[1] for m in _engine_modules()} == callers == {"vllm_engine", "vllm_generation"}


def test_the_async_facade_answers_every_call_the_engine_makes_on_vllm_llm():
    """``AsyncVLLMEngine`` runs ``VLLMEngine``'s code on an ``AsyncFacade``: each call and keyword must be served.

    Only sleep and wake_up are absent: colocated engines sleep, and partial rollouts refuse colocation.
    """
    calls: dict[str, set[str]] = {}
    for module in _engine_modules():
        for name, keywords in _calls_on_the_engine(inspect.getsource(module)).items():
            calls.setdefault(name, set()).update(keywords)
    assert {"generate", "collective_rpc", "get_tokenizer", "reset_prefix_cache"} <= set(calls)
    assert "lora_request" in calls["generate"]
    assert {name for name in calls if not hasattr(AsyncFacade, name)} == {"sleep", "wake_up"}
    for name, keywords in calls.items():
        if hasattr(AsyncFacade, name):
            accepted = set(inspect.signature(getattr(AsyncFacade, name)).parameters)
            assert keywords <= accepted, f"AsyncFacade.{name} lacks {sorted(keywords - accepted)}"
