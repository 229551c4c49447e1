"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``): names, config, atomic write.

The folder is the one Hugging Face peft writes with ``save_pretrained`` and reads with ``PeftModel.from_pretrained``,
and the one vLLM serves as a ``LoRARequest``: tensor keys ``base_model.model.<module>.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``), ``<module>`` the HF projection (``model.layers.3.self_attn.q_proj``), and
the config's ``r``, ``lora_alpha`` (scale ``lora_alpha / r``) and ``target_modules``. Written by the adapter weight
sync (``rollout/adapter_sync.py``) and the adapter export (``megatron_adapter/lora_gather.py``); torch-free but for
the tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from gtpo_megatron.config.lora import ATTENTION_PROJECTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterSpec:
    """What ``adapter_config.json`` records: rank ``r``, ``alpha`` (scale ``alpha / rank``), the HF projections."""

    rank: int
    alpha: float
    projections: tuple[str, ...]
    base_model: str = ""

    def config(self) -> dict:
        """The ``adapter_config.json`` fields peft (``LoraConfig``) and vLLM read; no dropout, no bias."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model,
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(self.projections), "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "inference_mode": True,
        }  # fmt: skip


def module_name(layer: int, projection: str) -> str:
    """The HF module of ``projection`` in decoder layer ``layer`` (global index): ``model.layers.3.mlp.up_proj``."""
    parent = "self_attn" if projection in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{parent}.{projection}"


def tensor_key(layer: int, projection: str, which: str) -> str:
    """The safetensors key of ``which`` (``"A"`` or ``"B"``): ``base_model.model.<module>.lora_A.weight``."""
    return f"{_PREFIX}{module_name(layer, projection)}.lora_{which}.weight"


def folder_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the adapter tensors (``numel * element_size`` summed): what one adapter sync moves."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_adapter_folder(folder: str | Path, tensors: dict[str, torch.Tensor], spec: AdapterSpec) -> Path:
    """Write ``tensors`` (``tensor_key`` names, any dtype) and ``spec`` as a PEFT folder replacing ``folder``.

    Assembled in a temporary sibling and renamed into place, so a reader (a vLLM worker) never sees half a folder.
    Returns ``folder``.

    Raises:
        ValueError: a key not of the ``base_model.model.<module>.lora_{A,B}.weight`` form.
    """
    from safetensors.torch import save_file

    bad = [key for key in tensors if not (key.startswith(_PREFIX) and key.endswith((".lora_A.weight",
                                                                                       ".lora_B.weight")))]  # fmt: skip
    if bad:
        raise ValueError(f"adapter tensor names {bad[:3]} are not PEFT keys (base_model.model.<module>.lora_A.weight)")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        cpu = {key: tensor.detach().to("cpu").contiguous() for key, tensor in sorted(tensors.items())}
        save_file(cpu, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(spec.config(), indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
