"""Benchmark: where the trainer's start-up goes, and what starting rank 0's rollout side in parallel saves (not a test).

Usage: ``python benchmarks/bench_startup.py [--model builtin:smollm2-135m-instruct] [--dtype bfloat16]``

One process (world size 1, TP 1), the pieces ``gtpo-train`` builds before step 1, each timed on its own in the
order the trainer needs them (wall clock; on a shared machine compare numbers taken at the same load):
imports (torch, transformers, megatron-core, vLLM: each the time its first import adds), the tokenizer, the
Megatron model build, the Hugging Face weight load into it (split out of ``MegatronPolicy.from_pretrained``), the
prompts (chat template on every problem, to drop the ones over ``max_prompt_len``), the vLLM engine (multiprocess,
as in training), the reward pool (math-verify workers) and the offline wandb run.

Then the same policy and rollout side again, first one after the other (the build before this change), then
overlapped as ``build.build_trainer`` does it (the rollout side in a thread while the policy loads), and the ratio.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import tempfile
import time
from contextlib import contextmanager

ROWS: list[tuple[str, float]] = []


@contextmanager
def timed(name: str):
    """Append ``(name, seconds)`` to ``ROWS``."""
    start = time.perf_counter()
    yield
    ROWS.append((name, time.perf_counter() - start))


def _policy(cfg, model_path, groups):
    from gtpo_megatron.build import build_policy

    return build_policy(cfg, model_path, groups)


def _placement(cfg, model_path) -> tuple:
    """``build_collector``'s placement, environment (the default) and exchange for the one engine of a one-process
    run."""
    from gtpo_megatron.build import build_exchange
    from gtpo_megatron.build_rollout import build_placements

    return build_placements(cfg, 1)[0], {}, build_exchange(cfg, model_path, num_engines=1)


def _breakdown(cfg, groups, model_path) -> None:
    """Every piece once, in order, into ``ROWS``."""
    from transformers import AutoTokenizer

    from gtpo_megatron.build_rollout import build_collector
    from gtpo_megatron.data.datasets import load_problems
    from gtpo_megatron.data.prompts import build_prompt_ids
    from gtpo_megatron.megatron_adapter import policy as policy_module
    from gtpo_megatron.rewards import RewardPool

    with timed("tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    load_weights = policy_module.hf_loading.load_hf_weights

    def timed_load(*args, **kwargs):
        with timed("  of which: HF weight load"):
            return load_weights(*args, **kwargs)

    policy_module.hf_loading.load_hf_weights = timed_load
    with timed("policy (model build + HF weights + DDP + optimizer)"):
        _policy(cfg, model_path, groups)
    policy_module.hf_loading.load_hf_weights = load_weights
    with timed("prompts (load + chat template on every problem)"):
        problems = load_problems(cfg.data.source, limit=cfg.data.limit)
        [build_prompt_ids(tokenizer, p.question) for p in problems]
    with timed("rollout side: prompts + vLLM engine + reward pool (build_collector)"):
        collector = build_collector(cfg, model_path, tokenizer, *_placement(cfg, model_path))
    collector.engine.close()
    collector.reward_pool.close()
    with timed("  reward pool alone"):
        RewardPool(cfg.reward.name, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s).close()
    with timed("wandb offline run"), tempfile.TemporaryDirectory() as folder:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        wandb.init(project="bench", dir=folder, mode="offline").finish()


def _serial_vs_overlapped(cfg, groups, model_path) -> tuple[float, float]:
    """Policy then rollout side, against both at once (the rollout side in a thread), in seconds."""
    from transformers import AutoTokenizer

    from gtpo_megatron.build_rollout import build_collector

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    start = time.perf_counter()
    _policy(cfg, model_path, groups)
    collector = build_collector(cfg, model_path, tokenizer, *_placement(cfg, model_path))
    serial = time.perf_counter() - start
    collector.engine.close()
    collector.reward_pool.close()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(build_collector, cfg, model_path, tokenizer, *_placement(cfg, model_path))
        _policy(cfg, model_path, groups)
        collector = future.result()
    overlapped = time.perf_counter() - start
    collector.engine.close()
    collector.reward_pool.close()
    return serial, overlapped


def main() -> None:
    """Print the breakdown and the serial/overlapped ratio (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", help="rollout.dtype (the demo serves bfloat16)")
    args = parser.parse_args()
    for module in ("torch", "transformers", "megatron.core", "vllm"):
        with timed(f"import {module}"):
            importlib.import_module(module)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29399")
    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.config import load_config
    from gtpo_megatron.parallel.groups import init_distributed

    cfg = load_config(
        "configs/cpu_demo.yaml",
        [f"model={args.model}", "parallel.tp_size=1", f"rollout.dtype={args.dtype}", "model.pad_attention_heads=false"],
    )
    model_path = resolve_model_path(cfg.model.name_or_path)
    groups = init_distributed(tp_size=1, pp_size=1, backend="gloo")
    _breakdown(cfg, groups, model_path)
    serial, overlapped = _serial_vs_overlapped(cfg, groups, model_path)
    total = sum(s for name, s in ROWS if not name.startswith("  "))
    print(f"{'phase':<72} {'s':>7} {'share':>6}")
    for name, seconds in ROWS:
        print(f"{name:<72} {seconds:7.1f} {seconds / total:6.0%}")
    print(f"{'sum of the top-level phases (one after the other)':<72} {total:7.1f}")
    print(
        f"policy + rollout side: one after the other {serial:.1f} s, overlapped {overlapped:.1f} s "
        f"(ratio {overlapped / serial:.2f}, {serial - overlapped:.1f} s saved)"
    )


if __name__ == "__main__":
    main()
