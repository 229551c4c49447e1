"""Megatron checkpoint of a training run -> Hugging Face folder that ``transformers`` and vLLM load.

A run written by ``gtpo-train`` looks like (names owned by ``run_dir``; written by ``trainer.Trainer.save``)::

    RUN_DIR/config.yaml                          the resolved run config (its ``model`` section names the base)
    RUN_DIR/checkpoints/step_000020/             one dist checkpoint (common.pt, metadata.json, *.distcp)
    RUN_DIR/checkpoints/latest                   text file: name of the newest complete step folder

``export_checkpoint_to_hf`` accepts the step folder, ``checkpoints/`` (its ``latest``) or the run dir. It rebuilds
the policy from the run's config in one process (TP = PP = 1; dist checkpoints reshard on load), loads the model's
tensors only (``checkpoint.load_model_weights``) and writes ``policy.export_hf`` into ``<step dir>/hf/`` (a
temporary sibling renamed). A LoRA run exports its merged weights there, or (``lora_format="adapter"``) its adapters
as a PEFT folder in ``<step dir>/hf_adapter/`` for peft or a vLLM ``LoRARequest`` on the run's base model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Literal

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.run_dir import adapter_export_dir, hf_export_dir, resolve_step_dir, run_config_path

LoRAFormat = Literal["merged", "adapter"]
LORA_FORMATS = ("merged", "adapter")

logger = logging.getLogger(__name__)


def export_checkpoint_to_hf(
    path: str | Path, out_dir: str | Path | None = None, *, overwrite: bool = False, lora_format: LoRAFormat = "merged"
) -> Path:
    """Convert a run's Megatron checkpoint into an HF folder (or a LoRA run's PEFT adapter folder); returns it.

    Args:
        path: step folder, ``checkpoints/`` folder (its ``latest``) or run dir.
        out_dir: destination; default ``<step dir>/hf`` (``<step dir>/hf_adapter`` for ``lora_format="adapter"``).
        overwrite: re-export even if ``out_dir`` holds its config file (else the existing folder is reused).
        lora_format: ``merged`` (full HF weights, adapters folded in) or ``adapter`` (a LoRA run's PEFT folder).

    Collectives: the policy's own on a 1-rank world (initialised here, torn down afterwards unless the caller
    had already initialised a 1-rank world).

    Raises:
        ValueError: ``path`` holds no checkpoint; an existing process group has more than one rank; an unknown
            ``lora_format``, or ``adapter`` for a run without ``model.lora``.
        FileNotFoundError: the run's ``config.yaml`` is missing.
    """
    if lora_format not in LORA_FORMATS:
        raise ValueError(f"lora_format={lora_format!r} is not one of {list(LORA_FORMATS)}")
    adapter = lora_format == "adapter"
    step_dir = resolve_step_dir(path)
    out = Path(out_dir) if out_dir is not None else (adapter_export_dir if adapter else hf_export_dir)(step_dir)
    if (out / ("adapter_config.json" if adapter else "config.json")).exists() and not overwrite:
        logger.info("reusing the exported folder %s", out)
        return out
    from gtpo_megatron.config import load_config
    from gtpo_megatron.megatron_adapter.checkpoint import load_model_weights

    cfg = load_config(run_config_path(step_dir))
    if adapter and not cfg.model.lora.enabled:
        raise ValueError(
            f"lora_format='adapter': the run {step_dir} trained without adapters (model.lora.rank=null); export its "
            "weights with lora_format='merged'"
        )
    logger.info("exporting %s (base model %s) to %s as %s", step_dir, cfg.model.name_or_path, out, lora_format)
    with _single_rank_world() as groups:
        policy = _build_export_policy(cfg, groups)
        load_model_weights(step_dir, policy)
        if adapter:
            from gtpo_megatron.megatron_adapter.lora_gather import export_adapter

            export_adapter(policy, str(out), cfg.model.lora, base_model=cfg.model.name_or_path)
        else:
            policy.export_hf(str(out))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterFolder:
    """A LoRA run's exported PEFT ``folder``, the ``base_model`` it adapts (folder or hub name) and its ``rank``."""

    folder: Path
    base_model: str
    rank: int


def export_adapter_folder(path: str | Path) -> AdapterFolder:
    """``export_checkpoint_to_hf(path, lora_format="adapter")`` (an existing export reused) and what it adapts.

    Raises:
        ValueError / FileNotFoundError: as :func:`export_checkpoint_to_hf` (not a run's checkpoint, no LoRA).
    """
    folder = export_checkpoint_to_hf(path, lora_format="adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    return AdapterFolder(folder, resolve_model_path(config["base_model_name_or_path"]), int(config["r"]))


def _build_export_policy(cfg, groups):
    """``build.build_policy`` with the run's model settings at TP = PP = 1 and the non-distributed optimizer.

    The export reads no optimizer state: one rank needs no distributed optimizer. The padding
    (vocabulary, and attention heads with ``model.pad_attention_heads``) is that of the run's TP size.
    """
    from gtpo_megatron.build import build_policy

    run_tp_size = cfg.parallel.tp_size
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel, tp_size=1, pp_size=1, sequence_parallel=False, use_distributed_optimizer=False
        ),
    )
    return build_policy(cfg, resolve_model_path(cfg.model.name_or_path), groups, padding_tp_size=run_tp_size)


@contextlib.contextmanager
def _single_rank_world():
    """Init a 1-rank gloo world with Megatron TP = PP = 1 and yield its ``ParallelGroups``.

    Uses a free local port unless MASTER_ADDR/PORT are set, and tears the world down afterwards if it created it.

    Raises:
        ValueError: a process group with more than one rank already exists.
    """
    import torch.distributed as dist

    from gtpo_megatron.parallel.groups import destroy_distributed, init_distributed

    owned = not dist.is_initialized()
    if not owned and dist.get_world_size() != 1:
        raise ValueError(
            f"export_checkpoint_to_hf runs in one process; the current process group has "
            f"{dist.get_world_size()} ranks. Call it before init_process_group or in a 1-rank job"
        )
    saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    if owned:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    try:
        yield init_distributed(tp_size=1, pp_size=1, backend="gloo")
    finally:
        if owned:
            destroy_distributed()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """``python -m gtpo_megatron.evaluation.checkpoint_export CKPT [OUT]``: export and print the HF folder."""
    import argparse

    parser = argparse.ArgumentParser(description=export_checkpoint_to_hf.__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="step folder, checkpoints/ folder (uses latest) or run dir")
    parser.add_argument("out", nargs="?", default=None, help="destination folder (default: <step dir>/hf)")
    parser.add_argument("--overwrite", action="store_true", help="re-export even if the destination exists")
    parser.add_argument(
        "--lora-format",
        choices=LORA_FORMATS,
        default="merged",
        help="a LoRA run: merged HF weights, or its PEFT adapter folder (default <step dir>/hf_adapter)",
    )
    args = parser.parse_args(argv)
    out = export_checkpoint_to_hf(args.checkpoint, args.out, overwrite=args.overwrite, lora_format=args.lora_format)
    print(out)  # noqa: T201 (CLI output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
