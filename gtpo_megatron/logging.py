"""Rank-0 logging: the logger's setup, the metric sink (jsonl, wandb, progress bar), the phase timer, the curves.

Modules log through ``logging.getLogger(__name__)`` (children of the ``gtpo_megatron`` logger); only rank 0 writes
anything: ``setup_logging(rank)`` lowers the other ranks to warnings, and ``MetricSink`` is built with
``enabled=False`` there. Metric names are ``group/name`` strings (``reward/mean``, ``time/step_s``);
values are plain Python floats/ints already reduced over the data-parallel group by the trainer.

wandb runs offline by default (``LoggingConfig.wandb_mode``); the environment variable ``WANDB_MODE`` wins when
set. Offline and disabled modes never touch the network; a failing ``wandb.init`` (for example ``online`` without
network) logs a warning and the run continues with jsonl only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from gtpo_megatron.config import LoggingConfig
from gtpo_megatron.run_dir import metrics_path

LOGGER_NAME = "gtpo_megatron"
PROGRESS_KEYS = (
    ("reward/mean", "reward"),
    ("accuracy", "acc"),
    ("entropy/completion_mean", "H"),
    ("time/rollout_s", "roll_s"),
    ("time/train_s", "train_s"),
    ("time/sync_s", "sync_s"),
)
CURVES = (
    ("reward/mean", "reward (mean)"),
    ("accuracy", "accuracy"),
    ("entropy/completion_mean", "entropy, mean over completions (nats)"),
)
logger = logging.getLogger(__name__)


# Third-party warnings about optional accelerators and settings this project does not use, by message start;
# ``report_optional_accelerators`` names the absent accelerators once instead.
_KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # megatron-core: each module names its fallback
    "Apex is not installed",  # megatron-core: torch LayerNorm/RMSNorm fallback
    "full scope is deprecated",  # megatron-core's own default of cuda_graph_scope; no CUDA graphs here
)
_KNOWN_CPU_WARNINGS = ("When using async grad allreduce it is recommended",)  # CUDA_DEVICE_MAX_CONNECTIONS
_ACCELERATORS = {"Apex": "apex", "Transformer Engine": "transformer_engine"}


def quiet_known_warnings(*, cuda: bool) -> None:
    """Hide the third-party warnings of ``_KNOWN_WARNINGS`` (and, without CUDA, the CUDA-only hints) in this process.

    Call before megatron-core is imported (it warns at import). ``logging.verbose=true`` skips this call.
    """
    for message in _KNOWN_WARNINGS + (() if cuda else _KNOWN_CPU_WARNINGS):
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)


def report_optional_accelerators(log: logging.Logger) -> None:
    """Say once which optional accelerators (Apex, Transformer Engine) are not installed, and what that means."""
    absent = [name for name, module in _ACCELERATORS.items() if importlib.util.find_spec(module) is None]
    if absent:
        log.info(
            "optional accelerators not installed: %s; megatron-core uses its PyTorch implementations instead "
            "(same results; fused kernels are faster on GPU: bash launch/install.sh gpu)",
            ", ".join(absent),
        )


def setup_logging(rank: int) -> logging.Logger:
    """INFO to stderr on rank 0, WARNING elsewhere; idempotent. Returns the project logger."""
    project = logging.getLogger(LOGGER_NAME)
    project.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not project.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[%(asctime)s rank{rank} %(levelname)s] %(message)s", "%H:%M:%S"))
        project.addHandler(handler)
        project.propagate = False
    return project


class MetricSink:
    """Writes one JSON object per step to ``output_dir/metrics.jsonl``, mirrors it to wandb and a progress bar.

    Args:
        output_dir: run folder (created).
        cfg: the logging section.
        run_config: plain dict of the resolved config (stored in the wandb run).
        max_steps: total steps (progress bar length).
        start_step: steps already completed (resume): lines with ``step > start_step`` are dropped from an
            existing metrics file so that a resumed run rewrites them exactly once.
        enabled: False on ranks other than 0 (every method is then a no-op).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        cfg: LoggingConfig,
        run_config: dict[str, Any],
        max_steps: int,
        start_step: int = 0,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.path = metrics_path(output_dir)
        self._wandb_run = None
        self._bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_after(self.path, start_step)
        self._wandb_run = _init_wandb(cfg, run_config, self.path.parent)
        if cfg.progress:
            from tqdm import tqdm

            label = progress_label(run_config.get("algorithm", {}).get("name", "gtpo"))
            self._bar = tqdm(total=max_steps, initial=start_step, desc=label, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step`` (1-based); non-finite values are written as null in jsonl."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log(dict(metrics), step=step)
        if self._bar is not None:
            self._bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in PROGRESS_KEYS if k in metrics})
            self._bar.update(1)

    def write(self, message: str) -> None:
        """Print a line above the progress bar (or through the logger when there is none)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            logger.info(message)

    def close(self) -> None:
        """Close the progress bar and finish the wandb run; idempotent."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def progress_label(algorithm: str) -> str:
    """The progress bar's label of ``algorithm.name``: ``GTPO``, ``GRPO``, ``DAPO``, ``Dr. GRPO``."""
    return "Dr. GRPO" if algorithm == "dr_grpo" else algorithm.upper()


def format_step_line(step: int, metrics: dict[str, float]) -> str:
    """One human-readable summary line of a step (the log line printed every ``trainer.log_every`` steps)."""
    keys = (
        "reward/mean",
        "accuracy",
        "format_rate",
        "entropy/completion_mean",
        "gtpo/filtered_frac",
        "gtpo/conflict_frac",
        "response/length_mean",
        "train/grad_norm",
        "time/step_s",
    )
    parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
    return f"step {step}: " + " ".join(parts)


class PhaseTimer:
    """Wall-clock seconds per named phase, reported as ``time/<name>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the ``with`` block as ``time/<name>_s``."""
        start = time.perf_counter()
        yield
        self.seconds[f"time/{name}_s"] = time.perf_counter() - start


def format_startup_line(seconds: dict[str, float], total_s: float) -> str:
    """The start-up summary line from the ``time/startup/<phase>_s`` entries of ``seconds`` (rounded to 0.1 s).

    ``rollout_side`` (rank 0's prompts, vLLM engine and reward pool) runs in parallel with ``policy`` and
    ``metric_sink``; ``rollout_side_wait`` is what the main thread waited for it afterwards.
    """
    prefix, suffix = "time/startup/", "_s"
    parts = [f"{k[len(prefix) : -len(suffix)]} {v:.1f}" for k, v in seconds.items() if k.startswith(prefix)]
    return f"start-up {total_s:.1f} s before step 1: " + ", ".join(parts) + " (rollout_side overlaps policy)"


def plot_curves(metrics_jsonl: str | Path, out_png: str | Path) -> None:
    """Plot reward, accuracy and entropy against step from a metrics file into a PNG (matplotlib Agg, no display).

    The entropy panel (``entropy/completion_mean``: the mean over completions of <H>_i, what the filter reads) marks
    ln 2, the threshold of the paper's entropy filter (docs/algorithm.md section 4).

    Raises:
        ValueError: if the file holds no step records.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{metrics_jsonl}: no metrics records to plot; run at least one training step")
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for axis, (key, title) in zip(fig.subplots(1, len(CURVES)), CURVES):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        axis.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
        if key == "entropy/completion_mean":
            axis.axhline(math.log(2), color="gray", linestyle="--", linewidth=1, label="ln 2")
            axis.legend(loc="best")
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    fig.savefig(out_png, dpi=110)


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _truncate_after(path: Path, start_step: int) -> None:
    """Keep only the records of steps ``<= start_step`` (all of them gone when starting from step 0)."""
    if not path.exists():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= start_step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def _init_wandb(cfg: LoggingConfig, run_config: dict[str, Any], run_dir: Path) -> Any:
    mode = os.environ.get("WANDB_MODE") or cfg.wandb_mode
    if mode == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        return wandb.init(project=cfg.wandb_project, config=run_config, dir=str(run_dir), mode=mode, name=run_dir.name)
    except Exception as exc:  # noqa: BLE001 - metrics still go to jsonl; wandb is a mirror
        logger.warning("wandb.init failed in mode %r (%s); continuing with metrics.jsonl only", mode, exc)
        return None
