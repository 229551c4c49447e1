"""gtpo-compare over seeds: runs grouped into methods by name, per-step mean and min-max band, the table's
final value with the seeds' range; synthetic metrics.jsonl files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gtpo_megatron.evaluation.compare import compare_runs, load_metrics, method_of, seed_band


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("run", "method"),
    [
        ("runs/cmp/gtpo/seed0", "gtpo"),
        ("runs/cmp/gtpo/seed12/metrics.jsonl", "gtpo"),
        ("runs/cmp/gtpo_seed1", "gtpo"),
        ("runs/gtpo-filter-seed1.jsonl", "gtpo-filter"),
        ("runs/cmp/dapo", "dapo"),
        ("runs/seedless.jsonl", "seedless"),
    ],
)
def test_method_of(run, method):
    assert method_of(run) == method


def test_seed_band_is_mean_min_max_over_the_seeds_that_logged_each_step(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"step": 1, "accuracy": 0.1}, {"step": 2, "accuracy": 0.5}])
    b = _jsonl(tmp_path / "b.jsonl", [{"step": 1, "accuracy": 0.3}, {"step": 2}, {"step": 3, "accuracy": 1.0}])
    steps, mean, low, high = seed_band([load_metrics(a), load_metrics(b)], "accuracy")
    assert steps == [1, 2, 3]
    assert mean == pytest.approx([0.2, 0.5, 1.0]) and low == [0.1, 0.5, 1.0] and high == [0.3, 0.5, 1.0]


def test_compare_groups_seeds_into_methods(tmp_path):
    rows = {
        "gtpo/seed0": [{"step": 1, "accuracy": 0.1, "gtpo/filtered_frac": 0.25}, {"step": 2, "accuracy": 0.3}],
        "gtpo/seed1": [{"step": 1, "accuracy": 0.2, "gtpo/filtered_frac": 0.75}, {"step": 2, "accuracy": 0.5}],
        "grpo/seed0": [{"step": 1, "accuracy": 0.4}],
    }
    runs = [str(_jsonl(tmp_path / name / "metrics.jsonl", r).parent) for name, r in rows.items()]
    runs[1] += "/metrics.jsonl"  # a file and folders mixed
    png, md = compare_runs(runs, tmp_path / "out")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| method | seeds | steps | accuracy final | accuracy mean |")
    # accuracy: finals 0.3 and 0.5 -> 0.4 [0.3, 0.5]; seed means 0.2 and 0.35 -> 0.275; filtered: finals 0.25, 0.75
    assert lines[2].startswith("| gtpo | 2 | 2 | 0.4 [0.3, 0.5] | 0.275 | - | - | - | - | 0.5 [0.25, 0.75] | 0.5 |")
    assert lines[3].startswith("| grpo | 1 | 1 | 0.4 | 0.4 | - | - |")
