"""``gtpo-compare RUN...``: training curves of several methods side by side, mean and spread over seeds.

Each RUN is a run directory (``RUN/metrics.jsonl``, written by the trainer: one JSON object per step, ``step`` plus
metric names such as ``reward/mean``) or a metrics jsonl file. Runs are grouped into methods by name
(:func:`method_of`): ``.../gtpo/seed1`` and ``.../gtpo_seed1`` are seed 1 of ``gtpo``; any other name is a method
of its own. Writes into ``--output`` (default ``.``):
- ``compare.png``: one panel per metric of ``METRICS`` (x = step): per method, the mean over its seeds at each step
  and a band from the lowest to the highest seed (the entropy panel marks ln 2, the paper filter's tau);
- ``compare.md``: per method, its seeds and steps, then per metric the final value (mean over seeds; with several
  seeds, the lowest and highest in brackets) and the mean over steps and seeds ("-" where no seed logged it). The
  table is also printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from gtpo_megatron.run_dir import METRICS_FILE, metrics_path

METRICS = (
    ("accuracy", "accuracy"),
    ("entropy/completion_mean", "mean entropy (nats)"),
    ("format_rate", "format rate"),
    ("gtpo/filtered_frac", "filtered fraction"),
    ("reward/mean", "reward"),
    ("gtpo/conflict_frac", "conflict fraction"),
    ("response/length_mean", "response length (tokens)"),
)
"""(metric, label) plotted and tabulated, in panel order: the comparison's four signals first (accuracy, the mean
over completions of <H>_i at ``algorithm.entropy_temperature``, format rate, fraction of completions the entropy
filter drops; GRPO and DAPO log 0 there), then reward, conflict fraction and response length."""


def load_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The step records of one run (``run_dir/metrics.jsonl``, or a jsonl file given directly).

    Raises:
        FileNotFoundError: no metrics file.
        ValueError: a line that is not a JSON object with a numeric ``step`` (names the file and line).
    """
    path = Path(run_dir)
    path = metrics_path(path) if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass run directories written by gtpo-train")
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                raise ValueError(f"{path}:{line_no} must be a JSON object with a numeric 'step' field")
            rows.append(row)
    return rows


def series(rows: Sequence[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` over the rows that logged a finite number for it."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


_SEED_NAME = re.compile(r"seed[_-]?\d+")
_SEED_SUFFIX = re.compile(r"(.+?)[_-]seed[_-]?\d+")
Runs = list[list[dict[str, float]]]
"""The step records of each seed of one method."""


def method_of(run: str | Path) -> str:
    """The method a run belongs to: its name (folder, or jsonl file stem) without a ``seed<N>`` part.

    ``a/gtpo/seed0`` and ``a/gtpo/seed0/metrics.jsonl`` -> ``gtpo``; ``gtpo_seed1`` or ``gtpo-seed1.jsonl`` ->
    ``gtpo``; ``dapo`` -> ``dapo``.
    """
    path = Path(run).resolve()
    path = path.parent if path.name == METRICS_FILE else path
    name = path.stem if path.suffix == ".jsonl" else path.name
    if _SEED_NAME.fullmatch(name):
        return path.parent.name
    match = _SEED_SUFFIX.fullmatch(name)
    return match.group(1) if match else name


def seed_band(runs: Runs, key: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(steps, mean, lowest, highest)`` of ``key`` over the seeds that logged it at each step."""
    by_step: dict[float, list[float]] = {}
    for rows in runs:
        for step, value in zip(*series(rows, key), strict=True):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (
        steps,
        [sum(by_step[s]) / len(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def _cells(runs: Runs, key: str) -> list[str]:
    finals = [values[-1] for _, values in (series(rows, key) for rows in runs) if values]
    means = [sum(values) / len(values) for _, values in (series(rows, key) for rows in runs) if values]
    if not finals:
        return ["-", "-"]
    final = f"{sum(finals) / len(finals):.4g}"
    if len(finals) > 1:
        final += f" [{min(finals):.4g}, {max(finals):.4g}]"
    return [final, f"{sum(means) / len(means):.4g}"]


def markdown_table(methods: dict[str, Runs]) -> str:
    """Per method: seeds, steps (the longest seed), then final and mean of each metric (4 significant digits)."""
    head = "| method | seeds | steps | " + " | ".join(f"{label} final | {label} mean" for _, label in METRICS) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(METRICS))]
    for name, runs in methods.items():
        cells = [name, str(len(runs)), str(max(len(rows) for rows in runs))]
        for key, _ in METRICS:
            cells += _cells(runs, key)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_methods(methods: dict[str, Runs], path: Path) -> None:
    """Write the PNG (matplotlib, Agg backend): one panel per metric, per method its seed mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = math.ceil((len(METRICS) + 1) / 2)  # one more panel for the legend
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8))
    for ax, (key, label) in zip(axes.flat, METRICS):
        for color, (name, runs) in enumerate(methods.items()):
            steps, mean, low, high = seed_band(runs, key)
            if steps:
                seeds = f"{len(runs)} seed" + ("s" if len(runs) > 1 else "")
                ax.plot(
                    steps, mean, color=f"C{color}", marker="o" if len(steps) == 1 else None, label=f"{name} ({seeds})"
                )
                if len(runs) > 1:
                    ax.fill_between(steps, low, high, color=f"C{color}", alpha=0.2, linewidth=0)
        if key == "entropy/completion_mean":
            ax.axhline(math.log(2), color="gray", linestyle="--", linewidth=1)  # the paper filter's tau
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[len(METRICS) :]:
        ax.axis("off")
    if handles:
        axes.flat[-1].legend(handles, labels, loc="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_runs(runs: Sequence[str], output_dir: str | Path = ".") -> tuple[Path, Path]:
    """Load every run, group them by :func:`method_of`, write ``compare.png`` and ``compare.md``; returns both.

    Raises:
        ValueError: no run given, or a malformed metrics file.
        FileNotFoundError: a run without ``metrics.jsonl``.
    """
    if not runs:
        raise ValueError("no runs given; pass run folders that contain metrics.jsonl, or metrics jsonl files")
    methods: dict[str, Runs] = {}
    for run in runs:
        methods.setdefault(method_of(run), []).append(load_metrics(run))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "compare.png", out / "compare.md"
    plot_methods(methods, png)
    md.write_text(markdown_table(methods))
    return png, md


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gtpo-compare``; prints the table. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="gtpo-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl) or metrics jsonl files")
    parser.add_argument("--output", default=".", help="folder for compare.png and compare.md")
    args = parser.parse_args(argv)
    try:
        png, md = compare_runs(args.runs, args.output)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    sys.stdout.write(md.read_text() + f"wrote {png} and {md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
