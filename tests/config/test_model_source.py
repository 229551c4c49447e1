"""``validate_config`` finds the model before anything starts: a built-in not yet on disk is materialised and a hub
name's config.json comes from the hub cache or the hub (monkeypatched here: no test touches the network), so the
model's checks run at once; a name found nowhere is one error naming the field, the value and the fix."""

from __future__ import annotations

import logging
import re

import huggingface_hub
import pytest
from huggingface_hub import errors
from transformers import LlamaConfig, Qwen3MoeConfig

from gtpo_megatron import builtin_models
from gtpo_megatron.config import load_config
from gtpo_megatron.megatron_adapter import validation
from gtpo_megatron.megatron_adapter.validation import validate_config
from tests.helpers.tiny_configs import SMALL

TYPO = "HuggingFaceTB/SmolLM2-135M-Instrct"
BUILT = {
    "tiny-qwen3-moe": Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2),
    "tiny-llama": LlamaConfig(**SMALL),
}


def _cfg(model: str, *overrides: str):
    return load_config(None, [f"model={model}", "output_dir=unused", "rollout.max_tokens=64", *overrides])


@pytest.fixture
def empty_builtin_cache(tmp_path, monkeypatch):
    """No built-in on disk; a build writes the model's config.json only (the weights play no part in the checks)."""
    monkeypatch.setenv("GTPO_CACHE_DIR", str(tmp_path / "cache"))
    built = []

    def build(target, builder):
        BUILT[target.name].save_pretrained(target)
        built.append(target.name)

    monkeypatch.setattr(builtin_models, "_locked_build", build)
    return built


@pytest.mark.parametrize(
    ("model", "overrides", "world", "fragment"),
    [
        (
            "builtin:tiny-qwen3-moe",
            ["parallel.ep_size=3", "rollout.num_prompts=3"],
            6,
            "parallel.ep_size=3 must divide the 8 experts",
        ),
        ("builtin:tiny-llama", ["parallel.ep_size=2"], 2, "is a dense model (no experts); set parallel.ep_size=1"),
        ("builtin:tiny-llama", ["rollout.routing_replay=rollout"], 1, "is a dense model (no experts to route to)"),
    ],
)
def test_a_builtin_not_yet_on_disk_is_materialised_for_the_model_checks(
    empty_builtin_cache, model, overrides, world, fragment
):
    validate_config(_cfg(model, *overrides), world, check_registries=False)  # gtpo-plan: what is on disk only
    with pytest.raises(ValueError, match=re.escape(fragment)):
        validate_config(_cfg(model, *overrides), world)
    assert empty_builtin_cache == [model.removeprefix("builtin:")]


@pytest.fixture
def hub(monkeypatch):
    """The hub calls ``validation`` makes, recorded; the cache is empty and the HEAD request raises ``head``."""
    calls, state = [], {"cached": None, "head": None}

    def cached(repo_id, filename):
        calls.append(("cache", repo_id))
        return state["cached"]

    def head(url):
        calls.append(("head", url))
        raise state["head"]

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", cached)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: pytest.fail("downloaded"))
    return calls, state


def _bare(error_type):
    """An instance of a hub HTTP error without the response its constructor needs."""
    return error_type.__new__(error_type)


@pytest.mark.parametrize(
    ("head_error", "rule"),
    [
        (OSError("[Errno -2] Name or service not known"), "not in the hub cache, and the hub cannot be reached"),
        (_bare(errors.RepositoryNotFoundError), "no such model on the hub"),
        (_bare(errors.GatedRepoError), "is gated on the hub"),
    ],
)
def test_a_hub_name_found_nowhere_is_one_error_with_the_fix(hub, head_error, rule):
    calls, state = hub
    state["head"] = head_error
    with pytest.raises(ValueError) as error:
        validate_config(_cfg(TYPO), 1)
    message = str(error.value)
    assert message.startswith(f"model.name_or_path={TYPO!r}: {rule}")
    if rule != "is gated on the hub":
        assert f"`hf download {TYPO}`" in message and "HF_HUB_OFFLINE" in message
    assert [kind for kind, _ in calls] == ["cache", "head"]  # one request: no retries


def test_a_path_that_is_no_hub_name_is_refused(hub):
    with pytest.raises(ValueError, match=r"model.name_or_path='runs/a/export': neither a local folder"):
        validate_config(_cfg("runs/a/export"), 1)


def test_the_hub_cache_gives_the_config_and_the_model_checks_run(hub, tmp_path):
    calls, state = hub
    LlamaConfig(**SMALL).save_pretrained(tmp_path)
    state["cached"] = str(tmp_path / "config.json")
    with pytest.raises(ValueError, match="parallel.ep_size=2 but org/dense is a dense model"):
        validate_config(_cfg("org/dense", "parallel.ep_size=2"), 2)
    assert calls == [("cache", "org/dense")]


def test_a_hub_server_error_defers_the_model_checks_in_one_line(hub, caplog):
    pytest.importorskip("megatron.core")
    calls, state = hub
    state["head"] = _bare(errors.HfHubHTTPError)
    with caplog.at_level(logging.WARNING, logger=validation.__name__):
        validate_config(_cfg("org/dense", "parallel.ep_size=2"), 2)
    [record] = caplog.records
    assert record.getMessage().startswith("org/dense: config.json not fetched")
    assert record.getMessage().endswith("deferred to the model's load: " + validation.DEFERRED)


def test_offline_mode_with_an_empty_hub_cache_is_refused_by_the_hub_itself(monkeypatch, tmp_path):
    """The real hub client in offline mode: nothing is requested, and the error comes at once."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="the hub cannot be reached .*offline mode is enabled"):
        validate_config(_cfg(TYPO), 1)
