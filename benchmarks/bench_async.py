"""Step time of sync, async and partial rollouts on CPU: one training rank and one separate engine, back to back.

Usage: ``python benchmarks/bench_async.py [--steps 5] [--modes sync,async] [--config configs/cpu_demo.yaml]
[--out runs/bench_async] [--train-core 0 --engine-core 1] [extra key=value overrides...]`` (not a test).

Every run is the CPU demo workload (``configs/cpu_demo.yaml``: SmolLM2-135M, 2 prompts x G=8, 64 new tokens) with
``parallel.tp_size=1`` and ``rollout.placement=separate``, through ``launch/run_local.sh`` (Intel OpenMP preload).
The product splits the cores between the training rank and the engine (``plan/engines.py:split_cores``); with
``--train-core``/``--engine-core`` the training rank is pinned by ``taskset`` instead (one OpenMP thread) and the
engine by ``VLLM_CPU_OMP_THREADS_BIND``. ``--modes`` (comma-separated, run in that order, the first one is the
baseline): ``sync``; ``async`` (k = 1, the default ``collective`` sync, which drains before each push);
``files-k1``, ``files-k2`` (``weight_sync=files``, the queue runs k batches ahead, TIS); ``partial-k1``,
``partial-k2`` (``rollout.partial_rollouts``: in-flight weight loads, every queued batch streamed at once). The
long-tailed workload: ``data.synthetic_difficulty=medium rollout.max_tokens=256``.

Printed, from each run's ``metrics.jsonl`` averaged over the steps after the first (the first holds start-up and,
in async mode, the one batch nothing overlaps):
- the phase times ``time/{rollout,old_logprob,train,sync,step}_s``, the async waits, the engine busy fraction and
  the mean staleness; generated tokens per second of wall time (``rollout/tokens_per_engine_max`` over
  ``time/step_s``) and per second of engine busy time;
- ``ideal = max(rollout, old_logprob + train + sync)`` of the baseline: the step a perfect overlap would reach;
- ``win = (baseline step - step) / (baseline step - ideal)`` of each other mode: the fraction of what overlap can win
  that it won (1.0: perfect; the acceptance bar is 0.5);
- ``async/staleness_mean`` and accuracy per step of each run.
The machine should be otherwise idle: other jobs on either core inflate one phase and not the other.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

from gtpo_megatron.evaluation.compare import load_metrics

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "old_logprob", "train", "sync", "step")
WAITS = ("async/rollout_wait_s", "async/trainer_wait_frac", "async/engine_busy_frac", "async/engine_busy_s",
         "async/pause_s", "async/staleness_mean")  # fmt: skip
FILES = ["rollout.mode=async", "rollout.weight_sync=files", "algorithm.off_policy_correction=tis"]
MODES = {
    "sync": ["rollout.mode=sync"],
    "async": ["rollout.mode=async", "rollout.max_staleness=1"],
    **{f"files-k{k}": [*FILES, f"rollout.max_staleness={k}"] for k in (1, 2)},
    **{f"partial-k{k}": [*FILES, f"rollout.max_staleness={k}", "rollout.partial_rollouts=true"] for k in (1, 2)},
}


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (other jobs on the machine may hold run_local.sh's default)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_mode(mode: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """Run ``args.steps`` steps in ``mode``; the rows of its ``metrics.jsonl``."""
    out = Path(args.out) / mode
    overrides = [
        "parallel.tp_size=1", "model.pad_attention_heads=false", "rollout.placement=separate",
        f"trainer.max_steps={args.steps}", f"output_dir={out}", "checkpoint.every_n_steps=1000",
        "checkpoint.save_on_sigterm=false", "logging.wandb_mode=disabled", "logging.progress=false",
        *MODES[mode], *extra,
    ]  # fmt: skip
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {"MASTER_PORT": str(free_port()), **os.environ, "NGPU": "1", "CONFIG": args.config,
           "LOG_DIR": str(out / "logs"), "PATH": path}  # fmt: skip
    command = ["bash", "launch/run_local.sh", *overrides]
    if args.train_core is not None:
        env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(args.engine_core)}
        command = ["taskset", "-c", str(args.train_core), *command]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return load_metrics(out)


def mean_after_first(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the steps after the first (0.0 where the metric is absent)."""
    return statistics.fmean(float(row.get(key) or 0.0) for row in rows[1:])


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean phase seconds after the first step, the async metrics, generated tokens per wall and per busy second."""
    means = {phase: mean_after_first(rows, f"time/{phase}_s") for phase in PHASES}
    tokens = mean_after_first(rows, "rollout/tokens_per_engine_max")
    busy_s = mean_after_first(rows, "async/engine_busy_s") or mean_after_first(rows, "time/generate_s")
    return means | {key: mean_after_first(rows, key) for key in WAITS} | {
        "tokens_per_s": tokens / means["step"], "tokens_per_busy_s": tokens / busy_s if busy_s else 0.0,
        "accuracy": mean_after_first(rows, "accuracy"),
    }  # fmt: skip


def report(results: dict[str, list[dict]]) -> None:
    """Print the table, the baseline's ideal overlapped step, each mode's win ratio, staleness and accuracy per step."""
    means = {mode: summary(rows) for mode, rows in results.items()}
    base_mode = next(iter(means))
    print(f"{'means over steps 2..n':<28}" + "".join(f"{mode:>11}" for mode in means))
    for key in means[base_mode]:
        print(f"{key:<28}" + "".join(f"{means[mode][key]:>11.2f}" for mode in means))
    base = means[base_mode]
    ideal = max(base["rollout"], base["old_logprob"] + base["train"] + base["sync"])
    can_win = base["step"] - ideal
    print(f"ideal overlapped step ({base_mode} run): {ideal:.2f} s; overlap can win {can_win:.2f} s")
    for mode in list(means)[1:]:
        won = base["step"] - means[mode]["step"]
        ratio = f"win {won / can_win:.2f}" if can_win > 0 else "nothing to win"
        print(f"{mode}: won {won:.2f} s, {ratio}, speed-up {base['step'] / means[mode]['step']:.2f}x")
    for mode, rows in results.items():
        print(f"{mode} async/staleness_mean per step: {[row.get('async/staleness_mean') for row in rows]}")
        print(f"{mode} accuracy per step: {[round(float(row['accuracy']), 3) for row in rows]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--config", default="configs/cpu_demo.yaml")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--modes", default="sync,async", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--train-core", type=int, default=None)
    parser.add_argument("--engine-core", type=int, default=1)
    args, extra = parser.parse_known_args()
    report({mode: run_mode(mode, args, extra) for mode in args.modes.split(",")})


if __name__ == "__main__":
    main()
