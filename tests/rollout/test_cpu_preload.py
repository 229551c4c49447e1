"""The CPU engine's preloads (``rollout/cpu_preload.py``): what is found, what is added, and that it reaches vLLM."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import pytest

from gtpo_megatron.rollout.cpu_preload import engine_environment, preload_libraries

IOMP, TCMALLOC = "/venv/lib/libiomp5.so", "libtcmalloc_minimal.so.4"


def test_preload_libraries_prefers_the_environments_intel_openmp(tmp_path: Path, monkeypatch):
    names = {"iomp5": "libiomp5.so", "tcmalloc_minimal": TCMALLOC}
    monkeypatch.setattr(ctypes.util, "find_library", names.get)
    assert preload_libraries(str(tmp_path)) == ["libiomp5.so", TCMALLOC]  # the system's
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    assert preload_libraries(str(tmp_path)) == [f"{tmp_path}/lib/libiomp5.so", TCMALLOC]
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert preload_libraries("/no/such/prefix") == []


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"LD_PRELOAD": f"{IOMP}:{TCMALLOC}", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ({"LD_PRELOAD": "/x/libother.so"},
         {"LD_PRELOAD": f"{IOMP}:{TCMALLOC}:/x/libother.so", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ({"LD_PRELOAD": "/opt/libiomp5.so"},
         {"LD_PRELOAD": f"{TCMALLOC}:/opt/libiomp5.so", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ({"LD_PRELOAD": f"/opt/libiomp5.so:/opt/{TCMALLOC}"}, {}),
        # another OpenMP already preloaded (vLLM puts torch's libgomp there in its own process): none added, as
        # vLLM refuses two OpenMP runtimes
        ({"LD_PRELOAD": "/torch.libs/libgomp-a34b3233.so.1"},
         {"LD_PRELOAD": f"{TCMALLOC}:/torch.libs/libgomp-a34b3233.so.1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ({"LD_PRELOAD": "/usr/lib/libomp.so"},
         {"LD_PRELOAD": f"{TCMALLOC}:/usr/lib/libomp.so", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
        ({"LD_PRELOAD": f"/torch.libs/libgomp.so.1:/opt/{TCMALLOC}"}, {}),
        ({"GTPO_CPU_PRELOAD": "0"}, {}),
    ],
)  # fmt: skip
def test_engine_environment_adds_what_ld_preload_lacks(environ: dict, expected: dict):
    assert engine_environment(environ, [IOMP, TCMALLOC]) == expected


def test_engine_environment_without_libraries_adds_nothing():
    assert engine_environment({"LD_PRELOAD": "/x/libother.so"}, []) == {}
