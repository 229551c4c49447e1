"""Outcomes and measurements of the GPU checks, and the one summary table ``run_gpu_checks.sh`` prints.

Two JSON-lines files per run, both appended while the checks run (so a check that later crashes or hangs its process
cannot take the earlier results with it):

* ``$GTPO_GPU_RESULTS``: one line per test phase, written by ``tests/gpu/results_plugin.py`` (:func:`write_result`);
* ``$GTPO_GPU_REPORT``: the numbers a check asserts on (:func:`record`: a max difference, a memory ratio, a time)
  and the rows of the benchmark tables (:func:`bench_row`).

``tests/gpu/run_checks.py`` runs each group of checks in its own process and joins both files and the groups'
exit states (:class:`GroupStatus`) into one table (:func:`build_table`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

REPORT_ENV = "GTPO_GPU_REPORT"
RESULTS_ENV = "GTPO_GPU_RESULTS"


def _append(env: str, line: dict) -> None:
    path = os.environ.get(env)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def record(check: str, quantity: str, value: float, *, limit: float | None = None, unit: str = "") -> None:
    """Append one measurement of ``check`` (the test function name) to ``$GTPO_GPU_REPORT`` when it is set.

    Args:
        check: test function name, e.g. ``"test_logprobs_entropy_cuda_vs_float64"``.
        quantity: what was measured, e.g. ``"max |d logprobs| bf16"``.
        value: the measured number.
        limit: the bound the test asserts (``value <= limit``), or None when it only reports.
        unit: unit shown after the value (``"s"``, ``"GiB"``, ``"nats"``).
    """
    _append(REPORT_ENV, {"check": check, "quantity": quantity, "value": float(value), "limit": limit, "unit": unit})


def bench_row(table: str, **columns: float | str) -> None:
    """Append one row of benchmark table ``table`` (``columns`` in order, e.g. ``variant="naive", ms=3.1``) to
    ``$GTPO_GPU_REPORT`` when it is set; the summary prints every table's rows under the checks."""
    _append(REPORT_ENV, {"table": table, "columns": columns})


def write_result(report) -> None:
    """Append one pytest ``TestReport`` (setup, call or teardown of a check) to ``$GTPO_GPU_RESULTS``."""
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        reason = getattr(report.longrepr, "reprcrash", None)
        reason = reason.message if reason is not None else str(report.longrepr)
    path, _, name = report.nodeid.partition("::")
    reason = reason.strip().splitlines()[0][:110] if reason and reason.strip() else ""
    _append(RESULTS_ENV, {"module": Path(path).stem, "name": name, "when": report.when, "outcome": report.outcome,
                          "seconds": report.duration, "reason": reason})  # fmt: skip


@dataclass
class CheckRow:
    """One check in the table: its test module, outcome, seconds, reason (skip/fail message) and measurements."""

    module: str
    name: str
    outcome: str
    seconds: float
    reason: str = ""
    measurements: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GroupStatus:
    """How one group's process ended: ``status`` is ``"ok"``, ``"failed"``, ``"timeout"``, ``"crashed"`` or
    ``"not run"``; ``detail`` says why (exit code, time limit, log file)."""

    name: str
    status: str
    seconds: float
    detail: str = ""


def read_results(path: str | Path) -> list[CheckRow]:
    """The checks of a results file in order, each with its final outcome.

    A failed setup or teardown is an ``error``, a failed call ``failed``, a skip in any phase ``skipped``; a check
    whose call never reported (its process died during it) is ``crashed``.
    """
    rows: dict[str, CheckRow] = {}
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    for item in (json.loads(line) for line in lines if line):
        crashed = CheckRow(item["module"], item["name"], "crashed", 0.0, "no result: its process died or was killed")
        row = rows.setdefault(item["name"], crashed)
        row.seconds += item["seconds"]
        if item["outcome"] == "skipped":
            row.outcome, row.reason = "skipped", item["reason"]
        elif item["outcome"] == "failed":
            row.outcome, row.reason = ("failed" if item["when"] == "call" else "error"), item["reason"]
        elif item["when"] == "call":
            row.outcome, row.reason = "passed", ""
    return list(rows.values())


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines written by :func:`record` (empty when the file does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _format_measurement(item: dict) -> str:
    text = f"{item['quantity']} = {item['value']:.3g}{(' ' + item['unit']) if item['unit'] else ''}"
    return text + (f" (limit {item['limit']:.3g})" if item["limit"] is not None else "")


def attach_records(rows: list[CheckRow], records: list[dict]) -> None:
    """Put each record under the row of the same name, else under the last row of that test function (the records
    of a parametrised test carry the parameters in their ``quantity``)."""
    by_name = {row.name: row for row in rows}
    last_of_function = {row.name.split("[", 1)[0]: row for row in rows}
    for item in (r for r in records if "check" in r):
        row = by_name.get(item["check"]) or last_of_function.get(item["check"])
        if row is not None:
            row.measurements.append(_format_measurement(item))


def _cell(value) -> str:
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.4g}"  # NaN: not measured (a dry run has no CUDA memory)
    return str(value)


def bench_lines(records: list[dict]) -> list[str]:
    """The rows of :func:`bench_row` as aligned tables, one per table name, in the order they were written."""
    tables: dict[str, list[dict]] = {}
    for item in (r for r in records if "table" in r):
        tables.setdefault(item["table"], []).append(item["columns"])
    lines = []
    for name, rows in tables.items():
        keys = list(dict.fromkeys(k for row in rows for k in row))
        cells = [keys] + [[_cell(row.get(k, "")) for k in keys] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(keys))]
        lines.append(f"bench: {name}")
        lines.extend("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in cells)  # fmt: skip
    return lines


OUTCOMES = ("passed", "failed", "error", "crashed", "skipped")


def build_table(groups: list[tuple[GroupStatus, list[CheckRow]]], bench: list[str] = ()) -> str:
    """The summary table: per group a header line, then one line per check (status, seconds, reason) with its
    measurements indented under it; then the ``bench`` lines (:func:`bench_lines`); the totals at the end."""
    rows = [row for _, group_rows in groups for row in group_rows]
    width = max([len(r.name) + 2 for r in rows] + [30])
    lines = [f"{'check':<{width}}  {'status':<8} {'seconds':>8}  key numbers / reason", "-" * (width + 60)]
    for status, group_rows in groups:
        detail = f": {status.detail}" if status.detail else ""
        lines.append(f"{status.name} [{status.status}, {status.seconds:.1f} s{detail}]")
        for row in group_rows:
            lines.append(f"  {row.name:<{width - 2}}  {row.outcome:<8} {row.seconds:8.1f}  {row.reason}".rstrip())
            lines.extend(f"{'':<{width}}    {m}" for m in row.measurements)
    if bench:
        lines.extend(["-" * (width + 60), *bench])
    counts = {o: sum(r.outcome == o for r in rows) for o in OUTCOMES}
    bad_groups = [s.name for s, _ in groups if s.status not in ("ok", "failed")]
    lines.append("-" * (width + 60))
    lines.append(
        ", ".join(f"{n} {o}" for o, n in counts.items())
        + f"; groups not finished: {bad_groups or 'none'}; {sum(s.seconds for s, _ in groups):.1f} s"
    )
    return "\n".join(lines)
