"""Code that runs inside every vLLM worker process: the ``worker_extension_cls`` of ``VLLMEngine``.

vLLM mixes :class:`WeightReloadExtension` into each worker (as the base of ``vllm_start.WorkerExtension``, which adds
the routed-experts capture); ``LLM.collective_rpc`` calls its methods by name.
Both weight paths end in one ``reload_weights`` pass, which re-runs ``process_weights_after_loading`` (the CPU
backend pre-packs linear weights): ``files`` reads staged safetensors shards, ``collective`` feeds the sender's
broadcast buckets (``rollout/weight_wire.py``) as they arrive, ``sharded`` the tensors joined from every sender's
parts (``rollout/sharded_wire.py``). Two layers a reload leaves in the wrong layout are
re-packed after it: a tied LM head (it loads nothing) and the CPU backend's MoE experts (vLLM re-packs experts for
its GPU kernels on an update but skips the CPU grouped-GEMM pre-pack, which leaves the experts scrambled: logits
off by 0.05-0.08 nats on a tiny Qwen3-MoE). This module does not import vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gtpo_megatron.parallel.weight_group import WeightGroupSpec, abandon, join_as_worker
from gtpo_megatron.rollout.engine import NamedTensor
from gtpo_megatron.rollout.sharded_wire import receive_shards
from gtpo_megatron.rollout.weight_wire import WireStats, receive_weights


def _staged_tensors(folder: str) -> Iterator[NamedTensor]:
    """``(name, tensor)`` of every safetensors shard in ``folder``, shard by shard (one shard in memory at a time)."""
    from safetensors import safe_open

    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def check_fused_groups_complete(names: set[str], packed_modules: dict[str, list[str]]) -> None:
    """Refuse (``ValueError`` naming them) an update missing members of a fused module it touches.

    vLLM fuses e.g. ``q/k/v_proj`` into ``qkv_proj``; reloading some members leaves the others undefined.
    """
    missing = set()
    for members in packed_modules.values():
        for name in names:
            parts = name.split(".")
            for i, part in enumerate(parts):
                if part in members:
                    siblings = {".".join([*parts[:i], m, *parts[i + 1 :]]) for m in members}
                    missing |= siblings - names
    if missing:
        raise ValueError(
            f"weight update is missing {sorted(missing)}: vLLM fuses these with weights in the update, so send "
            "every member of a fused module (q/k/v projections together, gate/up projections together)"
        )


class WeightReloadExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``); ``self`` is the worker."""

    def gtpo_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused-module map, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``."""
        return dict(getattr(self.model_runner.get_model(), "packed_modules_mapping", {}))

    def gtpo_parameters(self) -> dict[str, tuple[str, list[int], bytes]]:
        """This worker's parameters by vLLM name (its TP slice, kernel layout) as ``(dtype, shape, raw bytes)``.

        Raw bytes, so that a check compares them bit for bit (vLLM's RPC turns tensors into lists).
        """
        return {name: (str(p.dtype).removeprefix("torch."), list(p.shape),
                       p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                for name, p in self.model_runner.get_model().named_parameters()}  # fmt: skip

    def gtpo_reload_weights(self, weights_path: str) -> None:
        """``reload_weights`` of a folder of safetensors shards (as an iterator: a ``dummy`` engine has no loader)."""
        self.reload_weights(weights_iterator=_staged_tensors(weights_path))
        self._gtpo_repack_after_reload()

    def gtpo_join_weight_group(self, spec: dict[str, Any], worker_offset: int) -> None:
        """Join the weight group(s) as engine worker ``worker_offset + (this worker's rank in its engine)``.

        A link it replaces (a group rebuilt after a failed update) is abandoned: its receive may still be in flight.
        """
        spec = WeightGroupSpec.from_dict(spec)
        old = getattr(self, "_gtpo_weight_link", None)
        self._gtpo_weight_link = join_as_worker(spec, worker_index=worker_offset + self.rank)
        if old is not None:
            abandon(old.source)
            abandon(old.forward)

    def gtpo_receive_weights(self) -> dict[str, float]:
        """Receive one update (broadcast or sharded) into one ``reload_weights`` pass; returns its ``WireStats``.

        Raises:
            RuntimeError: not joined, or the sender failed half-way (the model is then partly updated).
        """
        link = getattr(self, "_gtpo_weight_link", None)
        if link is None:
            raise RuntimeError("gtpo_receive_weights called before gtpo_join_weight_group")
        start, stats = time.perf_counter(), WireStats()
        if link.sharded:
            updates = receive_shards(link.source, stats)
        else:
            updates = receive_weights(link.source, stats, forward=link.forward)
        try:
            self.reload_weights(weights_iterator=updates)
        finally:  # a failed load: drop the rest now (its traceback would keep the iterator open)
            updates.close()
        self._gtpo_repack_after_reload()
        seconds = time.perf_counter() - start
        return {"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes, "seconds": seconds,
                "transfer_s": stats.transfer_s}  # fmt: skip

    def _gtpo_repack_after_reload(self) -> None:
        """Put the layers a reload leaves in the wrong layout back in their kernels' (module docstring)."""
        model = self.model_runner.get_model()
        self._gtpo_repack_tied_head(model)
        for layer in model.modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if any(cls.__name__ == "CPUUnquantizedExperts" for cls in type(experts).__mro__):
                experts.process_weights_after_loading(layer)

    @staticmethod
    def _gtpo_repack_tied_head(model) -> None:
        """Re-pack a tied LM head after a reload (it loads nothing, so vLLM would keep its old CPU-packed copy)."""
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and quant_method is not None and not lm_head.weight.is_meta:
            quant_method.process_weights_after_loading(lm_head)
