"""The skip marker of tests that read the benchmark jsonl files (not part of the repository)."""

from __future__ import annotations

import pytest

from gtpo_megatron.data.datasets import default_data_dir


def needs_benchmark_data(*files: str) -> pytest.MarkDecorator:
    """Skip unless ``files`` (e.g. ``gsm8k/test.jsonl``) are in the data folder; the reason says how to get them."""
    data_dir = default_data_dir()
    missing = [name for name in files if not (data_dir / name).is_file()]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"needs the benchmark files {missing} under {data_dir}: run `gtpo-data --out DIR` once (needs "
        "`pip install datasets` and network) and set GTPO_DATA_DIR=DIR",
    )
