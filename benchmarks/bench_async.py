"""Step time of sync and async rollouts on CPU: one training rank and one separate engine, back to back (not a test).

Usage: ``python benchmarks/bench_async.py [--steps 5] [--config configs/cpu_demo.yaml] [--out runs/bench_async]
[--train-core 0] [--engine-core 1] [extra key=value overrides...]``

Both runs are the CPU demo workload (``configs/cpu_demo.yaml``: SmolLM2-135M, 2 prompts x G=8, 64 new tokens)
with ``parallel.tp_size=1`` and ``rollout.placement=separate``: the training rank is pinned to ``--train-core``
(``taskset``, one OpenMP thread) and the engine to ``--engine-core`` (``VLLM_CPU_OMP_THREADS_BIND``), so that
generation and training compete for no core. First ``rollout.mode=sync``, then ``rollout.mode=async
rollout.max_staleness=1``, each for ``--steps`` steps through ``launch/run_local.sh`` (Intel OpenMP preload).

Printed, from each run's ``metrics.jsonl`` averaged over the steps after the first (the first holds start-up and,
in async mode, the one batch nothing overlaps):
- the phase times ``time/{rollout,old_logprob,train,sync,step}_s`` and the async waits;
- ``ideal = max(rollout, old_logprob + train + sync)`` of the sync run: the step a perfect overlap would reach;
- ``win = (sync step - async step) / (sync step - ideal)``: the fraction of what overlap can win that async won
  (1.0: perfect; the acceptance bar is 0.5);
- ``async/staleness_mean`` per step of the async run (0 at step 1, 1 after).
The machine should be otherwise idle: other jobs on either core inflate one phase and not the other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from gtpo_megatron.evaluation.compare import load_metrics

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "old_logprob", "train", "sync", "step")
WAITS = ("async/rollout_wait_s", "async/trainer_wait_frac", "async/engine_busy_frac")
MODES = {"sync": ["rollout.mode=sync"], "async": ["rollout.mode=async", "rollout.max_staleness=1"]}


def run_mode(mode: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """Run ``args.steps`` steps in ``mode``; the rows of its ``metrics.jsonl``."""
    out = Path(args.out) / mode
    overrides = [
        "parallel.tp_size=1", "model.pad_attention_heads=false", "rollout.placement=separate",
        f"trainer.max_steps={args.steps}", f"output_dir={out}", "checkpoint.every_n_steps=1000",
        "checkpoint.save_on_sigterm=false", "logging.wandb_mode=disabled", "logging.progress=false",
        *MODES[mode], *extra,
    ]  # fmt: skip
    env = {**os.environ, "NGPU": "1", "CONFIG": args.config, "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(args.engine_core), "LOG_DIR": str(out / "logs"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    command = ["taskset", "-c", str(args.train_core), "bash", "launch/run_local.sh", *overrides]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return load_metrics(out)


def mean_after_first(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the steps after the first (0.0 where the metric is absent)."""
    return statistics.fmean(float(row.get(key) or 0.0) for row in rows[1:])


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean phase seconds after the first step, plus the async waits."""
    means = {phase: mean_after_first(rows, f"time/{phase}_s") for phase in PHASES}
    return means | {key: mean_after_first(rows, key) for key in WAITS}


def report(results: dict[str, list[dict]]) -> None:
    """Print the table, the ideal overlapped step, the win ratio and the staleness per step."""
    means = {mode: summary(rows) for mode, rows in results.items()}
    print(f"{'seconds per step (after step 1)':<34}" + "".join(f"{mode:>10}" for mode in means))
    for key in means["sync"]:
        print(f"{key:<34}" + "".join(f"{means[mode][key]:>10.2f}" for mode in means))
    sync = means["sync"]
    ideal = max(sync["rollout"], sync["old_logprob"] + sync["train"] + sync["sync"])
    can_win = sync["step"] - ideal
    won = sync["step"] - means["async"]["step"]
    print(f"ideal overlapped step (sync run): {ideal:.2f} s; overlap can win {can_win:.2f} s, async won {won:.2f} s")
    print(f"win = {won / can_win:.2f} of what overlap can win" if can_win > 0 else "win: nothing to win")
    print(f"speed-up async vs sync: {sync['step'] / means['async']['step']:.2f}x")
    staleness = [row.get("async/staleness_mean") for row in results["async"]]
    print(f"async/staleness_mean per step: {staleness}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--config", default="configs/cpu_demo.yaml")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--train-core", type=int, default=0)
    parser.add_argument("--engine-core", type=int, default=1)
    args, extra = parser.parse_known_args()
    report({mode: run_mode(mode, args, extra) for mode in MODES})


if __name__ == "__main__":
    main()
