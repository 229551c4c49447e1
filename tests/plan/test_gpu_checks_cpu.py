"""CPU tests of the GPU-check machinery: results and records, the table, the group runner, the wheel requirements,
and the whole ``run_gpu_checks.sh --dry-run`` (every check's CPU-capable part: the ops with fewer tokens, Megatron,
the 2-step trainer run on gloo).

They live outside ``tests/gpu`` (whose tests the root conftest skips without CUDA) so that they run in the default
suite and ``run_gpu_checks.sh`` cannot rot while no GPU is around.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.gpu import prepare, report, run_checks

REPO = Path(__file__).resolve().parents[2]


def _result(module, name, when, outcome, seconds=0.5, reason=""):
    return {"module": module, "name": name, "when": when, "outcome": outcome, "seconds": seconds, "reason": reason}


def test_results_records_and_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [
        _result("test_gpu_ops", "test_a[fp32]", "setup", "passed"),
        _result("test_gpu_ops", "test_a[fp32]", "call", "passed"),
        _result("test_gpu_ops", "test_b", "call", "failed", reason="AssertionError: assert 0.3 <= 0.05"),
        _result("test_gpu_ops", "test_c", "setup", "skipped", 0.0, "skipped: no TE (transformer_engine: ImportError)"),
        _result("test_gpu_trainer", "test_d", "setup", "failed", reason="fixture failed"),
        _result("test_gpu_trainer", "test_e", "setup", "passed"),  # its call never reported: the process died
    ]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setenv(report.REPORT_ENV, str(tmp_path / "records.jsonl"))
    report.record("test_a", "max |d logprobs| fp32", 3.2e-7, limit=2e-5, unit="nats")
    report.record("test_b", "mean |d logprob|", 0.3, limit=0.05)
    report.record("test_gone", "not a check", 1.0)  # dropped: no such check
    rows = report.read_results(tmp_path / "results.jsonl")
    assert [(r.name, r.outcome, r.seconds) for r in rows] == [
        ("test_a[fp32]", "passed", 1.0), ("test_b", "failed", 0.5), ("test_c", "skipped", 0.0),
        ("test_d", "error", 0.5), ("test_e", "crashed", 0.5)]  # fmt: skip
    report.attach_records(rows, report.read_records(tmp_path / "records.jsonl"))
    ops = report.GroupStatus("ops", "failed", 3.0, "see ops.log")
    trainer = report.GroupStatus("trainer", "timeout", 100.0, "killed after 100 s")
    table = report.build_table([(ops, rows[:3]), (trainer, rows[3:])])
    lines = table.splitlines()
    a = next(i for i, line in enumerate(lines) if line.lstrip().startswith("test_a[fp32]"))
    assert lines[a - 1] == "ops [failed, 3.0 s: see ops.log]" and "passed" in lines[a]
    assert "max |d logprobs| fp32 = 3.2e-07 nats (limit 2e-05)" in lines[a + 1]
    assert "mean |d logprob| = 0.3 (limit 0.05)" in lines[a + 3] and "not a check" not in table
    assert "skipped: no TE" in table and "trainer [timeout, 100.0 s: killed after 100 s]" in table
    assert lines[-1] == "1 passed, 1 failed, 1 error, 1 crashed, 1 skipped; groups not finished: ['trainer']; 103.0 s"


def test_record_and_results_are_silent_without_their_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(report.REPORT_ENV, raising=False)
    monkeypatch.delenv(report.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    report.record("test_a", "x", 1.0)
    report.write_result(SimpleNamespace(nodeid="f.py::t", when="call", outcome="passed", duration=1.0,
                                        skipped=False, failed=False, longrepr=None))  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(report.REPORT_ENV, str(tmp_path / "r.jsonl"))
    report.record("test_a", "x", 1.0, unit="s")
    assert json.loads((tmp_path / "r.jsonl").read_text()) == {
        "check": "test_a", "quantity": "x", "value": 1.0, "limit": None, "unit": "s"}  # fmt: skip


@pytest.mark.slow
def test_runner_keeps_results_when_a_group_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "test_hangs.py").write_text(
        "import time, pytest\npytestmark = pytest.mark.gpu\n"
        "def test_first():\n    pass\ndef test_hangs():\n    time.sleep(600)\n"
    )
    (checks / "test_after.py").write_text("import pytest\npytestmark = pytest.mark.gpu\ndef test_ok():\n    pass\n")
    groups = (run_checks.Group("hangs", str(checks / "test_hangs.py"), 8),
              run_checks.Group("after", str(checks / "test_after.py"), 60))  # fmt: skip
    monkeypatch.setattr(run_checks, "GROUPS", groups)
    start = time.monotonic()
    status = run_checks.main(["--out", str(tmp_path / "out"), "--dry-run", "--budget", "120"])
    assert status == 1 and time.monotonic() - start < 100
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "hangs [timeout" in summary and "after [ok" in summary
    outcomes = {r.name: r.outcome for r in report.read_results(tmp_path / "out" / "results.jsonl")}
    assert outcomes == {"test_first": "passed", "test_hangs": "crashed", "test_ok": "passed"}


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_prepare_checks_every_requirement_of_every_wheel(tmp_path: Path) -> None:
    good = [
        _wheel(tmp_path, "alpha", "1.0", ["torch>=2.6", "beta<=2.0,>=1.5", "colorama; sys_platform == 'win32'",
                                          "pytest-cov; extra == 'test'", "typing; python_version < '3.5'"]),
        _wheel(tmp_path, "beta", "2.0", ["sympy"]),
    ]  # fmt: skip
    prepare.check_requirements(good)  # the image has torch and sympy; the markers exclude the other three
    other = tmp_path / "other"
    other.mkdir()
    bad = [good[0], _wheel(other, "beta", "2.5", []), _wheel(other, "gamma", "1.0", ["wandb"])]
    with pytest.raises(SystemExit, match=r"alpha-1.0-py3-none-any.whl requires beta<=2.0,>=1.5; .*requires wandb"):
        prepare.check_requirements(bad)


@pytest.mark.slow  # about 60 s: every group's process on the CPU
def test_run_gpu_checks_dry_run_runs_every_group(tmp_path: Path) -> None:
    """``--dry-run``: every group runs in its own process on the CPU and the table lists every check."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", "tests/gpu/run_gpu_checks.sh", "--dry-run"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for line in (
        "ops [ok",
        "megatron [ok",
        "trainer [ok",
        "vllm [ok",
        "moe [ok",
        "test_moe_train_step_on_nccl",
        "test_trainer_run_two_steps[cpu:gloo,cuda:nccl]",
    ):
        assert line in summary, summary
    assert "skipped: no TE" in summary and "dry run: peak CUDA memory needs CUDA" in summary
    assert summary.splitlines()[-1].split(";")[0].endswith("0 crashed, 7 skipped")


def test_bench_rows_print_as_one_aligned_table_per_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(report.REPORT_ENV, str(tmp_path / "records.jsonl"))
    report.bench_row("op", variant="fused", ms=1.23456, roofline=float("nan"))
    report.record("test_a", "x", 1.0)  # a check's number: not a bench row
    report.bench_row("op", variant="megatron", ms=12.0, roofline=0.5)
    report.bench_row("step", s=2048, note="out of memory")
    lines = report.bench_lines(report.read_records(tmp_path / "records.jsonl"))
    assert lines == [
        "bench: op",
        "  variant      ms  roofline",
        "  fused     1.235       n/a",
        "  megatron     12       0.5",
        "bench: step",
        "  s" + " " * 14 + "note",
        "  2048  out of memory",
    ]
    table = report.build_table([(report.GroupStatus("bench", "ok", 1.0), [])], lines)
    assert "\n".join(lines) in table and table.splitlines()[-1].startswith("0 passed")


def test_bench_group_runs_only_when_asked() -> None:
    names = lambda groups: [g.name for g in groups]  # noqa: E731
    assert names(run_checks.selected_groups(bench=False, only=None)) == ["ops", "megatron", "trainer", "vllm", "moe"]
    assert names(run_checks.selected_groups(bench=True, only=None))[-2:] == ["bench", "bench_lora_moe"]
    assert names(run_checks.selected_groups(bench=False, only=["bench", "ops"])) == ["ops", "bench"]
    with pytest.raises(SystemExit, match=r"--only \['nope'\]: no such group"):
        run_checks.selected_groups(bench=False, only=["nope"])


def test_run_gpu_checks_bench_dry_run(tmp_path: Path) -> None:
    """``--dry-run --bench``'s two benchmark groups on the CPU at tiny sizes, their five tables in the summary
    (about 20 s on the idle 2-core machine: Megatron's import, 2-layer models, five checks)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    command = ["bash", "tests/gpu/run_gpu_checks.sh", "--dry-run", "--only", "bench", "bench_lora_moe"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "bench [ok" in summary and "bench_lora_moe [ok" in summary, summary
    assert summary.splitlines()[-1].startswith("5 passed, 0 failed"), summary
    tables = ("log-prob op, N=64", "training step, random Qwen2.5-1.5B-Instruct", "GTPO step", "LoRA vs full",
              "MoE training step, Qwen3-30B-A3B layers x 2")  # fmt: skip
    for table in tables:
        assert f"bench: {table}" in summary, summary
    assert "longest sequence that fits (micro-batch 1) = 64" in summary
