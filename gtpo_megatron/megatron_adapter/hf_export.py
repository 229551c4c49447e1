"""Write a Hugging Face folder (safetensors + config + tokenizer) from a stream of ``(hf_name, tensor)``.

Every model-parallel rank drains the stream (its collectives are matched); only the writer keeps tensors. Shards
of ``max_shard_bytes`` plus an index (or one ``model.safetensors``) are assembled in a temporary sibling and
renamed into place, so a reader never sees a half-written folder; it gets the umask's modes (``run_dir.open_modes``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from gtpo_megatron.run_dir import open_modes


def _flush(buffer: dict[str, torch.Tensor], folder: Path, index: int, weight_map: dict[str, str]) -> None:
    from safetensors.torch import save_file

    file_name = f"model-{index:05d}.safetensors"
    save_file(buffer, str(folder / file_name), metadata={"format": "pt"})
    weight_map.update({name: file_name for name in buffer})
    buffer.clear()


def write_hf_folder(
    weights: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    hf_config,
    tokenizer_source: str | None,
    write: bool,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Drain ``weights``; with ``write`` save them (moved to CPU) as an HF folder replacing ``out_dir`` atomically."""
    if not write:
        for _ in weights:
            pass
        return
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        _write_weights(weights, tmp, max_shard_bytes)
        hf_config.save_pretrained(tmp)
        if tokenizer_source is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(tmp)
        open_modes(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_weights(weights: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int) -> None:
    buffer: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    num_bytes, num_files = 0, 0
    for name, tensor in weights:
        buffer[name] = tensor.detach().to("cpu").contiguous()
        num_bytes += tensor.numel() * tensor.element_size()
        if num_bytes >= max_shard_bytes:
            num_files += 1
            _flush(buffer, folder, num_files, weight_map)
            num_bytes = 0
    if buffer:
        num_files += 1
        _flush(buffer, folder, num_files, weight_map)
    if num_files == 1:
        os.replace(folder / "model-00001.safetensors", folder / "model.safetensors")
        return
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
