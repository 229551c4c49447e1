"""vLLM serving the trained LoRA adapter (``rollout.lora_sync: adapter``): engine arguments and the served version.

Each version is a PEFT folder under a new ``LoRARequest`` int id, loaded into every worker at once (``add_lora``)
before the previous one is removed; vLLM keys cached prefixes by the adapter. vLLM is imported lazily.
"""

from __future__ import annotations

from gtpo_megatron.config.rollout import ENGINE_LORA_RANKS


def engine_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (``ENGINE_LORA_RANKS``) that holds an adapter of ``rank``.

    Raises:
        ValueError: ``rank`` above the largest (``model.lora.rank`` with ``rollout.lora_sync=adapter``).
    """
    fitting = [size for size in ENGINE_LORA_RANKS if size >= rank]
    if not fitting:
        raise ValueError(
            f"model.lora.rank={rank} is above vLLM's largest max_lora_rank {ENGINE_LORA_RANKS[-1]}; use "
            "rollout.lora_sync=merged or a smaller rank"
        )
    return fitting[0]


def lora_engine_kwargs(max_lora_rank: int | None) -> dict:
    """``vllm.LLM`` keyword arguments serving one adapter of rank <= ``max_lora_rank`` (None: no LoRA, ``{}``)."""
    if max_lora_rank is None:
        return {}
    # two CPU slots: the new version is loaded before the old one is removed
    return {"enable_lora": True, "max_lora_rank": engine_max_lora_rank(max_lora_rank), "max_loras": 1,
            "max_cpu_loras": 2}  # fmt: skip


class AdapterSlot:
    """The adapter version an engine serves: ``request`` (a ``vllm.lora.request.LoRARequest``, None before the first).

    ``llm``: the engine's ``vllm.LLM``. One slot per engine; versions are numbered 1, 2, ... (the int ids).
    """

    def __init__(self, llm) -> None:
        self._llm = llm
        self.request = None

    def load(self, folder: str) -> int:
        """Serve the PEFT adapter in ``folder`` from now on; returns its int id (the version).

        Raises:
            RuntimeError: vLLM could not load the folder (the previous version is still served).
        """
        from vllm.lora.request import LoRARequest

        version = 1 if self.request is None else self.request.lora_int_id + 1
        request = LoRARequest(lora_name=f"gtpo-adapter-{version}", lora_int_id=version, lora_path=folder)
        if not self._llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter folder {folder!r} (version {version})")
        if self.request is not None:
            self._llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request = request
        return version
