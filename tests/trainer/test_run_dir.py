"""Run folder and checkpoint naming (``run_dir``, the one owner): names, listing, the fresh-run guard, resolution."""

from __future__ import annotations

import pytest

from gtpo_megatron import run_dir


def _make(root, *names):
    for name in names:
        (root / name).mkdir(parents=True)


def test_names(tmp_path):
    assert run_dir.config_path(tmp_path) == tmp_path / "config.yaml"
    assert run_dir.metrics_path(tmp_path) == tmp_path / "metrics.jsonl"
    assert run_dir.curves_path(tmp_path) == tmp_path / "curves.png"
    assert run_dir.checkpoint_dir(tmp_path, 10) == tmp_path / "checkpoints" / "step_000010"
    assert run_dir.checkpoint_step(tmp_path / "checkpoints" / "step_000010") == 10
    assert run_dir.temporary_dir(tmp_path / "step_000010") == tmp_path / ".step_000010.tmp"
    assert run_dir.hf_export_dir(tmp_path / "step_000010") == tmp_path / "step_000010" / "hf"
    with pytest.raises(ValueError, match=r"checkpoint folder 'latest' is not named step_<step>"):
        run_dir.checkpoint_step("latest")


def test_list_checkpoints_counts_only_complete_step_folders(tmp_path):
    root = run_dir.checkpoints_dir(tmp_path)
    assert run_dir.list_checkpoints(root) == []  # no folder yet
    _make(root, "step_000010", "step_000002", ".step_000011.tmp", "step_foo", "hf")
    (root / "latest").write_text("step_000010")
    assert [p.name for p in run_dir.list_checkpoints(root)] == ["step_000002", "step_000010"]


def test_fresh_run_guard(tmp_path):
    run_dir.check_fresh_run(tmp_path, resume=False)  # nothing there yet
    _make(run_dir.checkpoints_dir(tmp_path), ".step_000001.tmp")
    run_dir.check_fresh_run(tmp_path, resume=False)  # an interrupted save is not a checkpoint
    _make(run_dir.checkpoints_dir(tmp_path), "step_000003")
    run_dir.check_fresh_run(tmp_path, resume=True)
    with pytest.raises(
        ValueError,
        match=r"holds checkpoints of an earlier run \(last: step_000003\); pass "
        r"resume=true to continue it or output_dir=<new folder>",
    ):
        run_dir.check_fresh_run(tmp_path, resume=False)


def test_latest_pointer_and_resolution(tmp_path):
    (tmp_path / "config.yaml").write_text("model: m\n")
    final = run_dir.checkpoint_dir(tmp_path, 4)
    final.mkdir(parents=True)
    (final / "common.pt").write_bytes(b"")
    run_dir.write_latest(final)
    root = run_dir.checkpoints_dir(tmp_path)
    assert (root / "latest").read_text() == "step_000004" and not (root / ".latest.tmp").exists()
    for path in (final, root, tmp_path):
        assert run_dir.is_megatron_checkpoint(path)
        assert run_dir.resolve_step_dir(path) == final
    assert run_dir.run_config_path(final) == (tmp_path / "config.yaml").resolve()
    assert not run_dir.is_megatron_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no checkpoint and no 'latest' file"):
        run_dir.resolve_checkpoint_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="must sit at RUN_DIR/checkpoints/<step>/"):
        run_dir.run_config_path(tmp_path / "moved" / "away" / "step_000001")
