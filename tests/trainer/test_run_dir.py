"""Run folder and checkpoint naming (``run_dir``, the one owner): names, listing, the fresh-run guard, resolution."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from gtpo_megatron import run_dir
from gtpo_megatron.resume import RunCheckpoints, agreed_checkpoint


def _make(root, *names, complete=True):
    """Step folders holding two files (``common.pt`` and a shard), marked complete unless ``complete=False``."""
    for name in names:
        folder = root / name
        (folder / "model").mkdir(parents=True)
        (folder / "common.pt").write_bytes(b"c" * 10)
        (folder / "model" / "__0_0.distcp").write_bytes(b"w" * 100)
        if complete:
            run_dir.mark_complete(folder)


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
    marker = json.loads((root / "step_000010" / "complete.json").read_text())
    assert marker == {"files": {"common.pt": 10, "model/__0_0.distcp": 100}}


def _truncated_folders(root):
    """One complete checkpoint (step 2) and four newer folders that are not checkpoints, each another way."""
    _make(root, "step_000002", "step_000004", "step_000005", "step_000006")
    (root / "step_000003").mkdir()
    (root / "step_000003" / "common.pt").write_bytes(b"c")  # a folder with one file: the save was killed
    (root / "step_000004" / "model" / "__0_0.distcp").unlink()  # a file lost after the save (partial copy)
    (root / "step_000005" / "model" / "__0_0.distcp").write_bytes(b"w" * 7)  # a truncated shard
    (root / "step_000006" / "complete.json").write_text("{not json")


def test_resume_takes_the_newest_complete_checkpoint_and_warns_about_the_rest(tmp_path, caplog):
    root = run_dir.checkpoints_dir(tmp_path)
    _truncated_folders(root)
    problems = {p.name: run_dir.checkpoint_problem(p) for p in sorted(root.iterdir())}
    assert problems == {
        "step_000002": None,
        "step_000003": "no complete.json (its save did not finish)",
        "step_000004": "model/__0_0.distcp is missing",
        "step_000005": "model/__0_0.distcp has 7 bytes, complete.json lists 100",
        "step_000006": "complete.json is unreadable",
    }
    assert [p.name for p in run_dir.list_checkpoints(root)] == ["step_000002"]
    with caplog.at_level(logging.WARNING, logger="gtpo_megatron.run_dir"):
        assert run_dir.newest_checkpoint(root) == root / "step_000002"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4 and all("skipped: resuming from an older one" in m for m in warned)
    assert "step_000005 is not a complete checkpoint (model/__0_0.distcp has 7 bytes" in warned[2]
    # `latest` naming an incomplete folder falls back to the newest complete one; an incomplete step folder given
    # by name is refused with the reason
    (root / "latest").write_text("step_000005")
    assert run_dir.resolve_checkpoint_dir(root) == root / "step_000002"
    with pytest.raises(ValueError, match=r"step_000003' is not a complete checkpoint \(no complete.json"):
        run_dir.resolve_checkpoint_dir(root / "step_000003")
    for name in ("step_000002", "step_000004", "step_000005", "step_000006"):
        run_dir.remove_checkpoint(root / name)
    assert run_dir.newest_checkpoint(root) is None
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        run_dir.resolve_checkpoint_dir(root)


def test_remove_checkpoint_drops_the_marker_first(tmp_path, monkeypatch):
    root = run_dir.checkpoints_dir(tmp_path)
    _make(root, "step_000001")
    monkeypatch.setattr(run_dir.shutil, "rmtree", lambda *a, **k: None)  # as if killed before deleting any file
    run_dir.remove_checkpoint(root / "step_000001")
    assert run_dir.list_checkpoints(root) == [] and (root / "step_000001" / "common.pt").exists()


def test_fresh_run_guard(tmp_path):
    run_dir.check_fresh_run(tmp_path, resume=False)  # nothing there yet
    (run_dir.checkpoints_dir(tmp_path) / ".step_000001.tmp").mkdir(parents=True)
    run_dir.check_fresh_run(tmp_path, resume=False)  # an interrupted save is not a checkpoint
    _make(run_dir.checkpoints_dir(tmp_path), "step_000003", complete=False)  # incomplete: still an earlier run's
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
    _make(final.parent, final.name)
    run_dir.write_latest(final)
    root = run_dir.checkpoints_dir(tmp_path)
    assert (root / "latest").read_text() == "step_000004" and not (root / ".latest.tmp").exists()
    for path in (final, root, tmp_path):
        assert run_dir.is_megatron_checkpoint(path)
        assert run_dir.resolve_step_dir(path) == final
    assert run_dir.run_config_path(final) == (tmp_path / "config.yaml").resolve()
    assert not run_dir.is_megatron_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        run_dir.resolve_checkpoint_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="must sit at RUN_DIR/checkpoints/<step>/"):
        run_dir.run_config_path(tmp_path / "moved" / "away" / "step_000001")


def test_steps_sort_by_number_not_by_name(tmp_path):
    # step_1000000 sorts before step_999999 as text; resume, pruning and the fresh-run guard go by the number
    root = tmp_path / "checkpoints"
    _make(root, "step_999999", "step_1000000")
    assert [p.name for p in run_dir.list_checkpoints(root)] == ["step_999999", "step_1000000"]
    assert run_dir.newest_checkpoint(root).name == "step_1000000"
    assert run_dir.list_checkpoints(root)[:-1] == [root / "step_999999"]  # the trainer prunes all but keep_last=1
    with pytest.raises(ValueError, match=r"last: step_1000000"):
        run_dir.check_fresh_run(tmp_path, resume=False)


def test_a_lagging_latest_gives_way_to_the_newest_complete_checkpoint(tmp_path, caplog):
    # a save killed between its folder's rename and the ``latest`` write: step 10 complete, ``latest`` at step 5
    (tmp_path / "config.yaml").write_text("model: m\n")
    root = run_dir.checkpoints_dir(tmp_path)
    _make(root, "step_000005", "step_000010")
    (root / "latest").write_text("step_000005")
    with caplog.at_level(logging.WARNING, logger="gtpo_megatron.run_dir"):
        for path in (root, tmp_path):  # what gtpo-eval and the export read
            assert run_dir.resolve_step_dir(path) == root / "step_000010"
    assert agreed_checkpoint(root, rank=0, group=None) == root / "step_000010"  # what the trainer resumes from
    assert "latest names step_000005, but" in caplog.text and "step_000010 is the newest complete" in caplog.text
    (root / "latest").unlink()  # killed before the first ``latest`` was written: the root is still a checkpoint
    assert run_dir.is_megatron_checkpoint(root) and run_dir.is_megatron_checkpoint(tmp_path)


def test_marker_rename_and_latest_reach_the_disk(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(run_dir.os, "fsync", lambda fd: synced.append(run_dir.os.readlink(f"/proc/self/fd/{fd}")))
    final = run_dir.checkpoint_dir(tmp_path, 3)
    _make(final.parent, final.name)  # mark_complete
    run_dir.write_latest(final)
    root = str(final.parent)
    assert synced == [
        str(final / ".complete.json.tmp"),
        str(final),
        root,  # the folder's rename into the root
        str(final.parent / ".latest.tmp"),
        root,
    ]


def test_pruning_keeps_step_1000000_over_step_999999(tmp_path):
    from tests.trainer.fakes import FakePolicy

    cfg = SimpleNamespace(output_dir=str(tmp_path), resume=False, checkpoint=SimpleNamespace(keep_last=1))
    empty = SimpleNamespace(state_dict=dict)
    checkpoints = RunCheckpoints(cfg, FakePolicy(), empty, empty, rank=0, group=None)
    checkpoints.save(999999)
    checkpoints.save(1000000)
    assert [p.name for p in run_dir.list_checkpoints(tmp_path / "checkpoints")] == ["step_1000000"]
