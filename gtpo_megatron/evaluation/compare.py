"""``gtpo-compare RUN_DIR...``: training curves of several runs side by side (GTPO vs GRPO vs DAPO).

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per step, written by the trainer; ``step`` plus metric names such
as ``reward/mean``) and writes, into ``--output`` (default ``.``):
- ``compare.png``: one subplot per metric in ``METRICS`` (x = step), one line per run (the entropy panel marks
  ln 2, the paper filter's threshold);
- ``compare.md``: a Markdown table with, per run, the number of steps and the final and mean value of each metric
  ("-" where a run never logged it). The table is also printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from gtpo_megatron.run_dir import metrics_path

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


def markdown_table(runs: dict[str, list[dict[str, float]]]) -> str:
    """Per run: steps, then final and mean of each metric (4 significant digits)."""
    head = "| run | steps | " + " | ".join(f"{label} final | {label} mean" for _, label in METRICS) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(METRICS))]
    for name, rows in runs.items():
        cells = [name, str(len(rows))]
        for key, _ in METRICS:
            _, values = series(rows, key)
            cells += [f"{values[-1]:.4g}", f"{sum(values) / len(values):.4g}"] if values else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_runs(runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Write the PNG (matplotlib, Agg backend): one subplot per metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = math.ceil((len(METRICS) + 1) / 2)  # one more panel for the legend
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8))
    for ax, (key, label) in zip(axes.flat, METRICS):
        for name, rows in runs.items():
            steps, values = series(rows, key)
            if values:
                ax.plot(steps, values, label=name)
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


def _labels(run_dirs: Sequence[str]) -> list[str]:
    names = [Path(d).resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def compare_runs(run_dirs: Sequence[str], output_dir: str | Path = ".") -> tuple[Path, Path]:
    """Load every run, write ``compare.png`` and ``compare.md`` into ``output_dir``; returns both paths.

    Raises:
        ValueError: no run given, or a malformed metrics file.
        FileNotFoundError: a run without ``metrics.jsonl``.
    """
    if not run_dirs:
        raise ValueError("no run directories given; pass one or more folders that contain metrics.jsonl")
    runs = {label: load_metrics(d) for label, d in zip(_labels(run_dirs), run_dirs)}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "compare.png", out / "compare.md"
    plot_runs(runs, png)
    md.write_text(markdown_table(runs))
    return png, md


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gtpo-compare``; prints the table. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="gtpo-compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
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
