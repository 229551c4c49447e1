"""The CPU demo with LoRA beside full fine-tuning, back to back in one invocation: learning, step time, memory.

Usage: ``python benchmarks/bench_lora.py [--steps 20] [--config configs/cpu_demo.yaml] [--out runs/bench_lora]
[--lora "model.lora.rank=16 ..."] [extra key=value overrides for both runs...]``

Both runs are the CPU demo workload at one rank (``parallel.tp_size=1``, the colocated engine), as
``gtpo-train --config configs/cpu_demo.yaml parallel.tp_size=1 model.pad_attention_heads=false`` runs it: first
LoRA with ``--lora`` (default: the README's LoRA demo override, rank 16, alpha 32 on all seven projections, lr 15x
the full run's), then full fine-tuning at the demo's lr (LoRA first: a LoRA setting that does not learn shows early).
While each runs, the benchmark reads ``/proc/<pid>/status`` every 0.5 s: ``VmHWM`` (the kernel's peak resident set)
of the training process, and the largest sum of ``VmRSS`` over the training process and its children (the vLLM
engine core) seen in a sample, and the training process's CPU seconds (user + system, start-up included).

Printed per run, from ``metrics.jsonl``: accuracy, mean of the first 5 and of the last 5 steps; ``time/step_s``,
``time/train_s`` and ``time/rollout_s``, means over the steps after the first (start-up); the two memory peaks; the
training process's CPU seconds per step (less sensitive than wall time to other jobs on the cores); and LoRA / full
ratios. Other jobs on the cores inflate step times: report ``uptime`` with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from gtpo_megatron.evaluation.compare import load_metrics

ROOT = Path(__file__).resolve().parents[1]
LORA_DEMO = "model.lora.rank=16 model.lora.alpha=32 optim.lr=3.0e-4 optim.min_lr=3.0e-4"
PHASES = ("step", "train", "rollout")


def _kib(pid: int, field: str) -> int:
    """``field`` (``VmHWM``, ``VmRSS``) of ``/proc/<pid>/status`` in KiB; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def watch(pid: int, done: threading.Event, peaks: dict[str, float]) -> None:
    """Until ``done``: the training process's ``VmHWM`` and CPU seconds, the largest summed ``VmRSS`` of its tree."""
    while not done.wait(0.5):
        try:
            process = psutil.Process(pid)
            tree = [pid, *(child.pid for child in process.children(recursive=True))]
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            return
        peaks["train_cpu_s"] = times.user + times.system
        peaks["train_hwm_kib"] = max(peaks["train_hwm_kib"], _kib(pid, "VmHWM"))
        peaks["tree_rss_kib"] = max(peaks["tree_rss_kib"], sum(_kib(p, "VmRSS") for p in tree))


def run(name: str, overrides: list[str], args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    """Train ``args.steps`` steps with ``overrides``; the rows of its ``metrics.jsonl`` and its memory peaks."""
    out = Path(args.out) / name
    command = [
        sys.executable, "-m", "gtpo_megatron.train", "--config", args.config, "parallel.tp_size=1",
        "model.pad_attention_heads=false", f"trainer.max_steps={args.steps}", f"output_dir={out}",
        "checkpoint.every_n_steps=1000", "checkpoint.save_on_sigterm=false", "logging.wandb_mode=disabled",
        "logging.progress=false", *overrides,
    ]  # fmt: skip
    print(f"[{name}] {shlex.join(command)}", flush=True)
    peaks, done = {"train_hwm_kib": 0, "tree_rss_kib": 0, "train_cpu_s": 0.0}, threading.Event()
    process = subprocess.Popen(command, cwd=ROOT, env=os.environ.copy())
    watcher = threading.Thread(target=watch, args=(process.pid, done, peaks), daemon=True)
    watcher.start()
    code = process.wait()
    done.set()
    watcher.join()
    if code != 0:  # each finished run's summary is in its bench_lora.json
        raise SystemExit(f"[{name}] exited with {code} (-9: most likely the OOM killer)")
    return load_metrics(out), peaks


def summary(rows: list[dict], peaks: dict[str, float]) -> dict[str, float]:
    """Accuracy first/last 5, phase means after the first step, training CPU seconds a step, memory peaks in GiB."""
    accuracy = [float(row["accuracy"]) for row in rows]
    means = {f"{p}_s": statistics.fmean(float(r[f"time/{p}_s"]) for r in rows[1:]) for p in PHASES}
    return {
        "accuracy_first5": statistics.fmean(accuracy[:5]), "accuracy_last5": statistics.fmean(accuracy[-5:]),
        **means, "train_peak_rss_gib": peaks["train_hwm_kib"] / 2**20,
        "tree_peak_rss_gib": peaks["tree_rss_kib"] / 2**20, "train_cpu_s_per_step": peaks["train_cpu_s"] / len(rows),
    }  # fmt: skip


def report(results: dict[str, dict[str, float]], rows: dict[str, list[dict]]) -> None:
    """The table of both runs and LoRA / full ratios, then the per-step accuracy."""
    print(f"{'':<22}{'full':>10}{'lora':>10}{'lora/full':>11}")
    for key in results["full"]:
        full, lora = results["full"][key], results["lora"][key]
        print(f"{key:<22}{full:>10.3f}{lora:>10.3f}{lora / full if full else float('nan'):>11.3f}")
    for name, run_rows in rows.items():
        print(f"accuracy per step, {name}: {[round(float(row['accuracy']), 2) for row in run_rows]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="configs/cpu_demo.yaml")
    parser.add_argument("--out", default="runs/bench_lora")
    parser.add_argument("--lora", default=LORA_DEMO, help="the LoRA run's overrides, space-separated")
    args, extra = parser.parse_known_args()
    rows, results = {}, {}
    for name, overrides in (("lora", [*args.lora.split(), *extra]), ("full", extra)):
        rows[name], peaks = run(name, overrides, args)
        results[name] = summary(rows[name], peaks)
        (Path(args.out) / name / "bench_lora.json").write_text(json.dumps(results[name], indent=1))
    report(results, rows)


if __name__ == "__main__":
    main()
