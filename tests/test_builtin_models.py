"""The built-in model cache (``builtin_models``): one build under a file lock, completeness, incomplete folders rebuilt.

A past fault: the first README command on a fresh machine failed with ``OSError: [Errno 39] Directory not
empty`` and left a model folder holding only tokenizer files, after which every run failed the same way. The
caches here are temporary folders (``GTPO_CACHE_DIR``) whose SmolLM2 entry links to the shared cache's (the tiny
models take their tokenizer from it), so only ``builtin:tiny-llama`` is built.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

from gtpo_megatron import builtin_models
from gtpo_megatron.builtin_models import missing_model_files, resolve_model_path

TINY = "builtin:tiny-llama"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh cache folder holding only a link to the shared cache's SmolLM2 (built there if needed)."""
    smollm2 = Path(resolve_model_path("builtin:smollm2-135m-instruct"))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2.name).symlink_to(smollm2)
    monkeypatch.setenv("GTPO_CACHE_DIR", str(cache))
    return cache


def _build_concurrently(cache: str, record: str, start, results) -> None:
    """One 'rank': count its own builds in ``record``, wait for the other, then resolve the tiny model."""
    os.environ["GTPO_CACHE_DIR"] = cache
    original = builtin_models._build_tiny

    def counted(out, arch):
        with open(record, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(1.0)  # widen the window in which the other process could start a build too
        original(out, arch)

    builtin_models._build_tiny = counted
    start.wait()
    results.put(resolve_model_path(TINY))


def test_two_processes_build_once_on_an_empty_cache(empty_cache, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start, results, record = ctx.Barrier(2), ctx.Queue(), tmp_path / "builds.txt"
    procs = [
        ctx.Process(target=_build_concurrently, args=(str(empty_cache), str(record), start, results)) for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    paths = [results.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert paths == [str(empty_cache / "tiny-llama")] * 2
    assert len(record.read_text().split()) == 1, "the second process must wait for the first build, not redo it"
    assert missing_model_files(paths[0]) == []
    leftovers = sorted(p.name for p in empty_cache.iterdir() if p.name not in {"tiny-llama", "smollm2-135m-instruct"})
    assert leftovers == [".tiny-llama.lock"]  # no temporary build folder left behind


def test_an_incomplete_folder_is_rebuilt_with_a_warning(empty_cache, caplog):
    broken = empty_cache / "tiny-llama"  # what the failed first run left: tokenizer files only
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(empty_cache / "smollm2-135m-instruct" / name, broken / name)
    assert missing_model_files(broken) == ["config.json", "model.safetensors"]
    with caplog.at_level(logging.WARNING, logger="gtpo_megatron.builtin_models"):
        path = resolve_model_path(TINY)
    assert path == str(broken) and missing_model_files(path) == []
    assert f"built-in model folder {broken} is incomplete (missing ['config.json', 'model.safetensors'])" in caplog.text
    assert resolve_model_path(TINY) == path  # complete now: used as it is, no second build
    assert len(caplog.records) == 1


def test_missing_model_files_names_what_is_missing(tmp_path):
    folder = tmp_path / "m"
    assert missing_model_files(folder) == ["the folder"]
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    )
    (folder / "model-1.safetensors").write_bytes(b"")
    assert missing_model_files(folder) == ["tokenizer_config.json", "a readable config.json", "model-2.safetensors"]
