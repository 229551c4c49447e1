"""Measurements of the GPU checks and the one summary table ``run_gpu_checks.sh`` prints.

A check calls :func:`record` for each number it asserts on (a max difference, a memory ratio, a time); records go
to the JSON-lines file named by ``$GTPO_GPU_REPORT`` (set by the script; without it nothing is written). After
pytest, ``python -m tests.gpu.report --junit J --records R`` joins pytest's JUnit XML (outcome and seconds of
every check) with the records into one table.
"""

from __future__ import annotations

import argparse
import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPORT_ENV = "GTPO_GPU_REPORT"


def record(check: str, quantity: str, value: float, *, limit: float | None = None, unit: str = "") -> None:
    """Append one measurement of ``check`` (the test function name) to ``$GTPO_GPU_REPORT`` when it is set.

    Args:
        check: test function name, e.g. ``"test_logprobs_entropy_cuda_vs_float64"``.
        quantity: what was measured, e.g. ``"max |d logprobs| bf16"``.
        value: the measured number.
        limit: the bound the test asserts (``value <= limit``), or None when it only reports.
        unit: unit shown after the value (``"s"``, ``"GiB"``, ``"nats"``).
    """
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    line = {"check": check, "quantity": quantity, "value": float(value), "limit": limit, "unit": unit}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


@dataclass
class CheckRow:
    """One test in the table: outcome, seconds, reason (skip/fail message) and its measurements."""

    name: str
    outcome: str
    seconds: float
    reason: str = ""
    measurements: list[str] = field(default_factory=list)


def read_junit(path: str | Path) -> list[CheckRow]:
    """Outcome (``passed``/``failed``/``error``/``skipped``), seconds and first message line of every test case."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = (node.get("message") or node.text or "").strip().splitlines()[0][:100]
                break
        rows.append(CheckRow(case.get("name", "?"), outcome, float(case.get("time", 0.0)), reason))
    return rows


def _format_measurement(item: dict) -> str:
    text = f"{item['quantity']} = {item['value']:.3g}{(' ' + item['unit']) if item['unit'] else ''}"
    return text + (f" (limit {item['limit']:.3g})" if item["limit"] is not None else "")


def build_table(rows: list[CheckRow], records: list[dict]) -> str:
    """The summary table: one block per check, measurements indented under it, totals at the end.

    A record goes under the row of the same name, else under the last row of that test function (the records of a
    parametrised test carry the parameters in their ``quantity``).
    """
    by_name = {row.name: row for row in rows}
    last_of_function = {row.name.split("[", 1)[0]: row for row in rows}
    for item in records:
        row = by_name.get(item["check"]) or last_of_function.get(item["check"])
        if row is not None:
            row.measurements.append(_format_measurement(item))
    width = max([len(r.name) for r in rows] + [5])
    lines = [f"{'check':<{width}}  {'result':<8} {'seconds':>8}  detail", "-" * (width + 40)]
    for row in rows:
        lines.append(f"{row.name:<{width}}  {row.outcome:<8} {row.seconds:8.1f}  {row.reason}".rstrip())
        lines.extend(f"{'':<{width}}    {m}" for m in row.measurements)
    counts = {o: sum(r.outcome == o for r in rows) for o in ("passed", "failed", "error", "skipped")}
    lines.append("-" * (width + 40))
    lines.append(", ".join(f"{n} {o}" for o, n in counts.items()) + f"; {sum(r.seconds for r in rows):.1f} s")
    return "\n".join(lines)


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines written by :func:`record` (empty when the file does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def main(argv: list[str] | None = None) -> None:
    """Print the summary table of one run of the GPU checks."""
    parser = argparse.ArgumentParser(description="summary table of tests/gpu/run_gpu_checks.sh")
    parser.add_argument("--junit", required=True, help="pytest --junitxml output")
    parser.add_argument("--records", required=True, help="JSON lines written through $GTPO_GPU_REPORT")
    args = parser.parse_args(argv)
    if not Path(args.junit).exists():
        raise SystemExit(f"no pytest report at {args.junit}: pytest did not finish (see its output above)")
    print(build_table(read_junit(args.junit), read_records(args.records)))


if __name__ == "__main__":
    main()
