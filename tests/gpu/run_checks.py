"""Run the GPU check groups one process each, within one time budget, and print the summary table.

``python -m tests.gpu.run_checks --out DIR [--dry-run] [--budget S] [pytest args]`` (``run_gpu_checks.sh`` calls it
after installing the wheels). Each group is a pytest run of one file in its own process group, with a time limit of
its own and never more than what is left of the budget, so a crash, a hang or an NCCL timeout in one group leaves the
others' results (and the table) intact. Writes ``DIR/<group>.log``, ``DIR/results.jsonl``, ``DIR/records.jsonl`` and
``DIR/summary.txt``. Exit status 0 when every group finished and no check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.gpu import report

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Group:
    """One process: a pytest file and its time limit in seconds; ``bench`` groups run only with ``--bench``."""

    name: str
    path: str
    limit_s: float
    bench: bool = False


BENCH_LIMITS_S = {"bench": 210, "bench_lora_moe": 90}
BENCH_BUDGET_S = sum(BENCH_LIMITS_S.values())
"""The bench groups' time limits, which ``run_gpu_checks.sh --bench`` adds to the default budget."""
DRY_RUN_SLOWDOWN = 4
"""A dry run computes on the CPU: each group's time limit is this many times its GPU limit (the budget is the
caller's)."""
GROUPS = (
    Group("ops", "tests/gpu/test_gpu_ops.py", 90),
    Group("megatron", "tests/gpu/test_gpu_megatron.py", 100),
    Group("trainer", "tests/gpu/test_gpu_trainer.py", 100),
    Group("vllm", "tests/gpu/test_gpu_policy_rollout.py", 150),
    Group("moe", "tests/gpu/test_gpu_moe.py", 60),
    Group("bench", "tests/gpu/test_gpu_bench.py", BENCH_LIMITS_S["bench"], bench=True),
    Group("bench_lora_moe", "tests/gpu/test_gpu_bench_lora_moe.py", BENCH_LIMITS_S["bench_lora_moe"], bench=True),
)


def environment_lines() -> list[str]:
    """torch, CUDA, the device, and which optional packages are importable (found, not imported)."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, device {device}"]
    for name in ("megatron.core", "transformer_engine", "vllm", "math_verify", "transformers"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        lines.append(f"  {name}: {'found' if found else 'missing (its checks skip)'}")
    return lines


def run_group(group: Group, *, out: Path, seconds: float, env: dict, pytest_args: list[str]) -> report.GroupStatus:
    """Run ``group`` for at most ``seconds``; its output goes to ``out/<name>.log``."""
    log = out / f"{group.name}.log"
    command = [sys.executable, "-m", "pytest", group.path, "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider",
               "-p", "tests.gpu.results_plugin", *pytest_args]  # fmt: skip
    start = time.monotonic()
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return report.GroupStatus(group.name, "timeout", time.monotonic() - start, f"killed after {seconds:.0f} s")
    elapsed = time.monotonic() - start
    if code in (0, 5):  # 5: nothing collected or everything deselected
        return report.GroupStatus(group.name, "ok", elapsed)
    if code == 1:
        return report.GroupStatus(group.name, "failed", elapsed, f"see {log.name}")
    return report.GroupStatus(group.name, "crashed", elapsed, f"exit {code}, see {log.name}")


def main(argv: list[str] | None = None) -> int:
    """Run every group, print and write the summary; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for logs, results and summary.txt")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU: CUDA-only checks skip")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for all groups together (330)")
    parser.add_argument(
        "--bench", action="store_true", help="also run the benchmark groups (tests/gpu/test_gpu_bench*.py)"
    )
    parser.add_argument("--only", nargs="+", metavar="GROUP", help="run only these groups (e.g. --only bench)")
    args, pytest_args = parser.parse_known_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results, records = out / "results.jsonl", out / "records.jsonl"
    for path in (results, records):
        path.unlink(missing_ok=True)
    print("\n".join(environment_lines()), flush=True)
    env = {**os.environ, report.RESULTS_ENV: str(results), report.REPORT_ENV: str(records),
           "GTPO_GPU_DRY_RUN": "1" if args.dry_run else "0"}  # fmt: skip
    deadline = time.monotonic() + args.budget
    statuses = []
    for group in selected_groups(bench=args.bench, only=args.only):
        left = deadline - time.monotonic()
        if left < 15:
            statuses.append(report.GroupStatus(group.name, "not run", 0.0, "the time budget is spent"))
            continue
        first = sum(1 for _ in open(results)) if results.exists() else 0
        limit = group.limit_s * (DRY_RUN_SLOWDOWN if args.dry_run else 1)
        status = run_group(group, out=out, seconds=min(limit, left), env=env, pytest_args=pytest_args)
        statuses.append(status)
        done = sum(1 for _ in open(results)) - first if results.exists() else 0
        print(f"[{group.name}] {status.status} in {status.seconds:.1f} s ({done} test phases reported)", flush=True)
    rows, recorded = report.read_results(results), report.read_records(records)
    report.attach_records(rows, recorded)
    table = report.build_table(by_group(statuses, rows), report.bench_lines(recorded))
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    unfinished = any(s.status not in ("ok", "failed") for s in statuses)
    return 1 if unfinished or any(r.outcome in ("failed", "error", "crashed") for r in rows) else 0


def selected_groups(*, bench: bool, only: list[str] | None) -> list[Group]:
    """The groups to run: the correctness groups, the bench groups with ``bench``; ``only`` keeps those named.

    Raises:
        SystemExit: a name in ``only`` that is no group.
    """
    unknown = sorted(set(only or ()) - {g.name for g in GROUPS})
    if unknown:
        raise SystemExit(f"run_checks: --only {unknown}: no such group; the groups are {[g.name for g in GROUPS]}")
    return [g for g in GROUPS if (g.name in only if only else bench or not g.bench)]


def by_group(
    statuses: list[report.GroupStatus], rows: list[report.CheckRow]
) -> list[tuple[report.GroupStatus, list[report.CheckRow]]]:
    """Each group's status with its checks (a check belongs to the group of the file it came from)."""
    module_group = {Path(g.path).stem: g.name for g in GROUPS}
    return [(s, [r for r in rows if module_group.get(r.module) == s.name]) for s in statuses]


if __name__ == "__main__":
    raise SystemExit(main())
