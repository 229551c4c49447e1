"""CPU tests of the GPU-check machinery: the summary table, the records, and the ops checks run on the CPU.

They live outside ``tests/gpu`` (whose tests the root conftest skips without CUDA) so that they run in the default
suite and ``run_gpu_checks.sh`` cannot rot while no GPU is around.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import report

REPO = Path(__file__).resolve().parents[2]
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
  <testcase classname="tests.gpu.test_gpu_ops" name="test_a[fp32]" time="1.25"/>
  <testcase classname="tests.gpu.test_gpu_ops" name="test_b" time="2.5">
    <failure message="AssertionError: assert 0.3 &lt;= 0.05&#10;second line">traceback</failure></testcase>
  <testcase classname="tests.gpu.test_gpu_policy_rollout" name="test_c" time="0.0">
    <skipped type="pytest.skip" message="vLLM is not installed">skip</skipped></testcase>
  <testcase classname="tests.gpu.test_gpu_policy_rollout" name="test_d" time="0.5">
    <error message="fixture failed">boom</error></testcase>
</testsuite></testsuites>
"""


def test_summary_table_joins_outcomes_and_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    monkeypatch.setenv(report.REPORT_ENV, str(tmp_path / "records.jsonl"))
    report.record("test_a", "max |d logprobs| fp32", 3.2e-7, limit=2e-5, unit="nats")
    report.record("test_b", "mean |d logprob|", 0.3, limit=0.05)
    report.record("test_gone", "not in the junit file", 1.0)  # dropped: no such test
    rows = report.read_junit(tmp_path / "junit.xml")
    assert [(r.name, r.outcome, r.seconds) for r in rows] == [
        ("test_a[fp32]", "passed", 1.25), ("test_b", "failed", 2.5), ("test_c", "skipped", 0.0),
        ("test_d", "error", 0.5)]  # fmt: skip
    assert rows[1].reason == "AssertionError: assert 0.3 <= 0.05"
    table = report.build_table(rows, report.read_records(tmp_path / "records.jsonl"))
    lines = table.splitlines()
    a = next(i for i, line in enumerate(lines) if line.startswith("test_a[fp32]"))
    assert "passed" in lines[a] and "max |d logprobs| fp32 = 3.2e-07 nats (limit 2e-05)" in lines[a + 1]
    assert "vLLM is not installed" in table and "not in the junit file" not in table
    assert "mean |d logprob| = 0.3 (limit 0.05)" in lines[a + 3]  # under test_b, the next row
    assert lines[-1] == "1 passed, 1 failed, 1 error, 1 skipped; 4.2 s"


def test_record_is_silent_without_the_environment_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(report.REPORT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    report.record("test_a", "x", 1.0)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(report.REPORT_ENV, str(tmp_path / "r.jsonl"))
    report.record("test_a", "x", 1.0, unit="s")
    assert json.loads((tmp_path / "r.jsonl").read_text()) == {
        "check": "test_a", "quantity": "x", "value": 1.0, "limit": None, "unit": "s"}  # fmt: skip


def test_ops_checks_pass_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA checks' arithmetic and tolerances, run on the CPU (one log-prob case, every loss)."""
    from tests.gpu import test_gpu_ops

    monkeypatch.setattr(test_gpu_ops, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(test_gpu_ops, "NUM_TOKENS", 48)  # float64 over 152k columns is slow on 2 cores
    test_gpu_ops.test_logprobs_entropy_cuda_vs_float64(torch.bfloat16, 2e-2, 1000)
    for name in sorted(test_gpu_ops.LOSS_CASES):
        test_gpu_ops.test_policy_loss_cuda_vs_float64(name)


def test_run_gpu_checks_dry_run_prints_the_table(tmp_path: Path) -> None:
    result = subprocess.run(["bash", "tests/gpu/run_gpu_checks.sh", "--dry-run", "-k", "policy_loss"], cwd=REPO,
                            env={**os.environ, "OUT_DIR": str(tmp_path), "PYTHON": sys.executable},
                            capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "test_policy_loss_cuda_vs_float64[gtpo]" in summary and summary.splitlines()[-1].startswith("0 passed")
