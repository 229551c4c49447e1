"""MetricSink (jsonl, resume truncation, wandb modes) and the curves plot."""

from __future__ import annotations

import json
import math

import pytest

from gtpo_megatron.config import LoggingConfig
from gtpo_megatron.logging import MetricSink, format_step_line, plot_curves, progress_label


def _sink(tmp_path, mode="disabled", start_step=0, enabled=True):
    cfg = LoggingConfig(wandb_mode=mode, progress=False)
    return MetricSink(tmp_path, cfg=cfg, run_config={"a": 1}, max_steps=5, start_step=start_step, enabled=enabled)


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_one_object_per_step_and_nan_as_null(tmp_path):
    sink = _sink(tmp_path)
    sink.log(1, {"reward/mean": 0.5, "entropy/completion_mean": math.nan})
    sink.log(2, {"reward/mean": 1.0, "entropy/completion_mean": 0.3})
    sink.close()
    assert _records(tmp_path) == [
        {"step": 1, "reward/mean": 0.5, "entropy/completion_mean": None},
        {"step": 2, "reward/mean": 1.0, "entropy/completion_mean": 0.3},
    ]


def test_disabled_rank_writes_nothing(tmp_path):
    sink = _sink(tmp_path, enabled=False)
    sink.log(1, {"reward/mean": 0.5})
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    sink = _sink(tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"x": float(step)})
    sink.close()
    resumed = _sink(tmp_path, start_step=2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    assert [(r["step"], r["x"]) for r in _records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_wandb_offline_writes_local_run_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = _sink(tmp_path / "offline", mode="offline")
    sink.log(1, {"reward/mean": 0.25})
    sink.close()
    assert list((tmp_path / "offline" / "wandb").glob("offline-run-*"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = _sink(tmp_path / "env", mode="offline")
    sink.log(1, {"reward/mean": 0.25})
    sink.close()
    assert not (tmp_path / "env" / "wandb").exists()


def test_plot_curves_writes_png(tmp_path):
    sink = _sink(tmp_path)
    for step in range(1, 4):
        sink.log(step, {"reward/mean": step / 3, "accuracy": step / 4, "entropy/completion_mean": 1.0 / step})
    sink.close()
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    data = (tmp_path / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_curves_rejects_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics records"):
        plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")


def test_step_line_lists_known_keys_in_order():
    line = format_step_line(3, {"accuracy": 0.5, "reward/mean": 1.25, "other": 9.0})
    assert line == "step 3: reward/mean=1.25 accuracy=0.5"
    line = format_step_line(1, {"entropy/completion_mean": 0.5, "entropy/token_mean": 0.7, "format_rate": 0.25})
    assert line == "step 1: format_rate=0.25 entropy/completion_mean=0.5"


def test_known_third_party_warnings_are_hidden_and_accelerators_named_once(monkeypatch, caplog):
    import warnings

    from gtpo_megatron.logging import quiet_known_warnings, report_optional_accelerators

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(cuda=False)
        for message in (
            "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
            "Apex is not installed. Falling back to Torch Norm",
            "When using async grad allreduce it is recommended to set ...",
            "something else",  # not on the list: shown
        ):
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings(cuda=True)  # on GPU the CUDA_DEVICE_MAX_CONNECTIONS hint stays
        warnings.warn("When using async grad allreduce it is recommended to set ...", UserWarning, stacklevel=1)
    assert len(caught) == 1
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with caplog.at_level("INFO", logger="gtpo_megatron"):
        report_optional_accelerators(__import__("logging").getLogger("gtpo_megatron.test"))
    assert caplog.messages == [
        "optional accelerators not installed: Apex, Transformer Engine; megatron-core uses its PyTorch "
        "implementations instead (same results; fused kernels are faster on GPU: bash launch/install.sh gpu)"
    ]


def test_startup_line_lists_the_phases():
    from gtpo_megatron.logging import format_startup_line

    seconds = {"time/startup/imports_s": 6.04, "time/startup/policy_s": 3.96, "time/step_s": 9.0}
    assert format_startup_line(seconds, 12.34) == (
        "start-up 12.3 s before step 1: imports 6.0, policy 4.0 (rollout_side overlaps policy)"
    )


def test_progress_bar_is_labelled_by_the_configured_algorithm(tmp_path, capsys):
    assert [progress_label(n) for n in ("gtpo", "grpo", "dapo", "dr_grpo")] == ["GTPO", "GRPO", "DAPO", "Dr. GRPO"]
    cfg = LoggingConfig(wandb_mode="disabled", progress=True)
    sink = MetricSink(tmp_path, cfg=cfg, run_config={"algorithm": {"name": "dapo"}}, max_steps=2)
    sink.close()
    assert "DAPO:" in capsys.readouterr().err
