"""Run folder and checkpoint naming: the one owner of every path a run writes or reads back (torch-free).

A run folder (``output_dir``) holds::

    config.yaml                      the resolved config (``train.py``)
    metrics.jsonl                    one JSON object per step (``logging.MetricSink``)
    curves.png                       reward, accuracy and entropy curves (``trainer.py``)
    checkpoints/step_000010/         one Megatron dist checkpoint per saved step (``megatron_adapter.checkpoint``)
    checkpoints/step_000010/complete.json   written last: the checkpoint's files and sizes (completeness marker)
    checkpoints/.step_000010.tmp/    a save in progress, renamed into place when complete
    checkpoints/latest               text file: the name of the last checkpoint saved (informational)
    checkpoints/step_000010/hf/      its Hugging Face export, made on demand (``evaluation.checkpoint_export``)

Checkpoint folders are ``step_`` plus the 1-based step on six digits or more, ordered by that number
(``step_999999`` before ``step_1000000``). A folder is complete when its ``complete.json`` exists and lists every
file with its size (:func:`checkpoint_problem`); the marker is written last and deleted first, and the marker, the
rename and ``latest`` are each fsync'd before the next, so no interrupted save, delete or copy is taken for a
checkpoint. Every reader (resume, ``gtpo-eval``, the export) takes the newest complete one
(:func:`newest_checkpoint`), even when ``latest`` lags it. A Megatron-LM / Megatron-Bridge checkpoint
(``model.megatron_checkpoint``) is laid out as those trainers write it::

    latest_checkpointed_iteration.txt   the newest iteration number, or "release"
    iter_0000100/                       one dist checkpoint (torch_dist) per saved iteration (``release/``)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
LATEST_FILE = "latest"
HF_SUBDIR = "hf"
ADAPTER_SUBDIR = "hf_adapter"
COMPLETE_MARKER = "complete.json"
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
logger = logging.getLogger(__name__)


def config_path(output_dir: str | Path) -> Path:
    """``output_dir/config.yaml``: the resolved config of the run."""
    return Path(output_dir) / CONFIG_FILE


def metrics_path(output_dir: str | Path) -> Path:
    """``output_dir/metrics.jsonl``: one JSON object per step."""
    return Path(output_dir) / METRICS_FILE


def curves_path(output_dir: str | Path) -> Path:
    """``output_dir/curves.png``: the training curves."""
    return Path(output_dir) / CURVES_FILE


def checkpoints_dir(output_dir: str | Path) -> Path:
    """``output_dir/checkpoints``: the root of the run's checkpoint folders."""
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``output_dir/checkpoints/step_NNNNNN``: the checkpoint folder of (1-based) ``step``."""
    return checkpoints_dir(output_dir) / f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(folder: str | Path) -> int:
    """The step number in a checkpoint folder's name (``step_000010`` -> 10).

    Raises:
        ValueError: the name is not ``step_`` followed by digits.
    """
    name = Path(folder).name
    if not _is_step_name(name):
        raise ValueError(f"checkpoint folder {name!r} is not named {CHECKPOINT_PREFIX}<step>, e.g. step_000010")
    return int(name[len(CHECKPOINT_PREFIX) :])


def _is_step_name(name: str) -> bool:
    return name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX) :].isdigit()


def temporary_dir(final: str | Path) -> Path:
    """The sibling folder a checkpoint is written into before it is renamed to ``final`` (``.<name>.tmp``)."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp"


def _step_folders(folder: str | Path) -> list[Path]:
    """Every folder named ``step_NNNNNN`` in the checkpoint root ``folder`` (complete or not), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and _is_step_name(p.name)), key=checkpoint_step)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries: a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_modes(folder: str | Path) -> None:
    """Give ``folder`` and all it holds the modes of a plain ``mkdir`` / ``open`` (0777 / 0666 less the umask).

    For a folder assembled under ``tempfile.mkdtemp`` (0700) and filled by writers that create files 0600
    (safetensors), before it is renamed into place: exports and built-in models are meant to be read by others.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(Path(root) / name, 0o777 & ~umask)
        for name in files:
            os.chmod(Path(root) / name, 0o666 & ~umask)


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name, renamed into place; file and folder flushed to disk."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def mark_complete(folder: str | Path) -> None:
    """Write ``folder/complete.json`` (every file and its size, renamed into place) after the last write."""
    folder = Path(folder)
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }
    _write_durably(folder / COMPLETE_MARKER, json.dumps({"files": files}, indent=0))


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint (one line), or None when it is (module docstring)."""
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return f"no {COMPLETE_MARKER} (its save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{COMPLETE_MARKER} is unreadable"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {COMPLETE_MARKER} lists {size}"
    return None


def remove_checkpoint(folder: str | Path) -> None:
    """Delete a checkpoint folder, its completeness marker first (a killed delete leaves an incomplete folder)."""
    folder = Path(folder)
    (folder / COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoint folders ``step_NNNNNN`` in the checkpoint root ``folder``, oldest first."""
    return [p for p in _step_folders(folder) if checkpoint_problem(p) is None]


def newest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in the root ``folder``, or None; warns once per incomplete step folder."""
    complete = list_checkpoints(folder)
    for step_folder in _step_folders(folder):
        problem = checkpoint_problem(step_folder)
        if problem is not None:
            newer = not complete or checkpoint_step(step_folder) > checkpoint_step(complete[-1])
            logger.warning(
                "%s is not a complete checkpoint (%s); %s",
                step_folder,
                problem,
                "skipped: resuming from an older one" if newer else "ignored",
            )
    return complete[-1] if complete else None


def check_fresh_run(output_dir: str | Path, *, resume: bool) -> None:
    """A fresh run (``resume=false``) never writes over an earlier run's checkpoints (complete or not) and metrics.

    Raises:
        ValueError: ``output_dir`` holds a checkpoint folder and ``resume`` is False (names both fixes).
    """
    earlier = _step_folders(checkpoints_dir(output_dir))
    if not resume and earlier:
        raise ValueError(
            f"output_dir={str(output_dir)!r} holds checkpoints of an earlier run (last: {earlier[-1].name}); "
            "pass resume=true to continue it or output_dir=<new folder> to start a new run"
        )


def write_latest(final: str | Path) -> None:
    """Point ``latest`` at ``final``, once ``final``'s rename into its checkpoint root is on disk (both flushed)."""
    final = Path(final)
    _fsync(final.parent)
    _write_durably(final.parent / LATEST_FILE, final.name)


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The complete checkpoint that ``path`` (a step folder or a checkpoint root) designates.

    For a root, the newest complete one, with a warning when ``latest`` names another.

    Raises:
        ValueError: ``path`` is an incomplete step folder (names what is wrong), or a root without a complete
            checkpoint, or neither.
    """
    path = Path(path)
    if _is_step_folder(path):
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(
                f"checkpoint path={str(path)!r} is not a complete checkpoint ({problem}); pass a complete one or "
                "its checkpoints/ root (the newest complete checkpoint is taken)"
            )
        return path
    newest = newest_checkpoint(path)
    if newest is None:
        raise ValueError(
            f"checkpoint path={str(path)!r} holds no complete checkpoint (step_NNNNNN with {COMPLETE_MARKER})"
        )
    pointer = path / LATEST_FILE
    named = pointer.read_text().strip() if pointer.is_file() else newest.name
    if named != newest.name:
        logger.warning("%s names %s, but %s is the newest complete checkpoint: using it", pointer, named, newest)
    return newest


def _is_step_folder(path: Path) -> bool:
    """``path`` is meant as one checkpoint (complete or not): its marker, Megatron's files or a ``step_`` name."""
    return any((path / name).exists() for name in (COMPLETE_MARKER, "common.pt", "metadata.json")) or (
        _is_step_name(path.name) and path.is_dir()
    )


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a step folder, a ``checkpoints/`` root holding one (or ``latest``), or its run dir."""
    path = Path(path)
    if not path.is_dir():
        return False
    roots = [path, *([path / CHECKPOINTS_DIR] if (path / CONFIG_FILE).exists() else [])]
    return _is_step_folder(path) or any((root / LATEST_FILE).exists() or _step_folders(root) for root in roots)


def resolve_step_dir(path: str | Path) -> Path:
    """The checkpoint step folder that ``path`` (step folder, ``checkpoints/`` root or run dir) designates.

    Raises:
        ValueError: ``path`` is none of the three (names the path and what was looked for).
    """
    path = Path(path)
    if (path / CONFIG_FILE).exists() and (path / CHECKPOINTS_DIR).is_dir():
        path = path / CHECKPOINTS_DIR
    return resolve_checkpoint_dir(path)


def run_config_path(step_dir: str | Path) -> Path:
    """``RUN_DIR/config.yaml`` of a step folder ``RUN_DIR/checkpoints/step_NNNNNN``.

    Raises:
        FileNotFoundError: no ``config.yaml`` two levels up (the checkpoint was moved out of its run dir).
    """
    step_dir = Path(step_dir)
    config = step_dir.resolve().parent.parent / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(
            f"{config} not found: the checkpoint {step_dir} must sit at RUN_DIR/checkpoints/<step>/ next to the "
            f"run's {CONFIG_FILE} (it names the base model); copy the run's {CONFIG_FILE} there"
        )
    return config


def hf_export_dir(step_dir: str | Path) -> Path:
    """``<step dir>/hf``: where a checkpoint's Hugging Face export goes by default."""
    return Path(step_dir) / HF_SUBDIR


def adapter_export_dir(step_dir: str | Path) -> Path:
    """``<step dir>/hf_adapter``: where a LoRA checkpoint's PEFT adapter export goes by default."""
    return Path(step_dir) / ADAPTER_SUBDIR


def resolve_megatron_lm_checkpoint(path: str | Path) -> Path:
    """The dist-checkpoint folder of a Megatron-LM / Megatron-Bridge checkpoint (module docstring).

    ``path``: an iteration folder (with ``metadata.json``) or the root whose tracker names one.

    Raises:
        ValueError: ``path`` is neither, or the folder the tracker names is not a dist checkpoint.
    """
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    tracker = path / MEGATRON_LM_TRACKER
    if not tracker.is_file():
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r} holds neither a dist checkpoint (metadata.json) nor "
            f"{MEGATRON_LM_TRACKER}; give a Megatron-LM/Megatron-Bridge checkpoint root or one iter_NNNNNNN folder"
        )
    marker = tracker.read_text().strip()
    if marker != "release" and not marker.isdigit():
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r}: {MEGATRON_LM_TRACKER} holds {marker!r}, neither an iteration "
            "number nor 'release'; point model.megatron_checkpoint at the iter_NNNNNNN folder to load"
        )
    folder = path / (marker if marker == "release" else f"iter_{int(marker):07d}")
    if not (folder / "metadata.json").is_file():
        raise ValueError(
            f"model.megatron_checkpoint={str(path)!r}: {MEGATRON_LM_TRACKER} says {marker!r} but {folder} is not a "
            "dist checkpoint (torch_dist format, with metadata.json); convert legacy per-rank checkpoints with "
            "Megatron-LM's checkpoint converter"
        )
    return folder
