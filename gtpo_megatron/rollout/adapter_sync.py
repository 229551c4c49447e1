"""``rollout.lora_sync: adapter``: each weight sync sends only the LoRA adapters, as a PEFT folder per engine.

The weight gather's ranks gather the adapters (``lora_gather``); rank 0 broadcasts them to the other engine leaders
(skipped when it leads the only engine); each leader writes a PEFT folder in node-local staging (``staging.py``)
and its engine serves it under the next LoRA id (``vllm_lora.py``), the previous folder removed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gtpo_megatron.parallel.collectives import broadcast_object
from gtpo_megatron.rollout.peft_adapter import AdapterSpec, folder_bytes, write_adapter_folder
from gtpo_megatron.rollout.staging import open_staging_dir

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from gtpo_megatron.rollout.engine_guard import GuardedEngine

AdapterGather = Callable[[], "dict[str, torch.Tensor]"]
"""The adapters' ``{peft key: full tensor}`` (a collective over the model-parallel group: ``lora_gather``)."""


class AdapterWeightSync:
    """This rank's part of an adapter-only sync.

    ``engine``: this rank's guarded engine if it leads one; ``gather``: the adapters' gather, run on the ranks of
    the weight gather (``exporting``); ``world``: the group of the broadcast to the other leaders (None: rank 0
    leads the only engine); ``staging_dir``: parent of the staging folder (default ``node_local.staging_root``).
    """

    def __init__(
        self,
        *,
        engine: GuardedEngine | None,
        gather: AdapterGather,
        exporting: bool,
        is_sender: bool,
        spec: AdapterSpec,
        world: dist.ProcessGroup | None,
        staging_dir: str | None = None,
    ) -> None:
        self.engine, self.gather, self.exporting, self.is_sender = engine, gather, exporting, is_sender
        self.spec, self.world = spec, world
        self.version = 0
        self._staging, self._remove_staging = (None, None) if engine is None else open_staging_dir(self, staging_dir)

    def sync(self, stream=None) -> dict[str, float]:
        """Send the current adapters to every engine; ``stream`` (the merged weights) is ignored.

        Returns ``sync/bytes``, ``sync/megabytes``, ``sync/num_tensors``, ``sync/adapter_version`` and
        ``time/sync_s`` on the sender (global rank 0), ``{}`` elsewhere.

        Raises:
            RuntimeError: an engine failed to load the folder (``GuardedEngine``: naming it); it is then unusable.
        """
        start = time.perf_counter()
        tensors = self.gather() if self.exporting else None
        tensors = broadcast_object(tensors if self.is_sender else None, src=0, group=self.world)
        self.version += 1
        if self.engine is not None:
            self._serve(tensors)
        if not self.is_sender:
            return {}
        num_bytes = folder_bytes(tensors)
        return {
            "sync/bytes": float(num_bytes),
            "sync/megabytes": num_bytes / 2**20,
            "sync/num_tensors": float(len(tensors)),
            "sync/adapter_version": float(self.version),
            "time/sync_s": time.perf_counter() - start,
        }

    def _serve(self, tensors: dict) -> None:
        """Write version ``self.version``'s folder and have this rank's engine serve it; drop the previous folder."""
        folder = write_adapter_folder(self._staging / f"adapter-{self.version:06d}", tensors, self.spec)
        self.engine.load_adapter(str(folder))
        previous = self._staging / f"adapter-{self.version - 1:06d}"
        if previous.is_dir():
            shutil.rmtree(previous, ignore_errors=True)

    def close(self) -> None:
        """Remove the staging folder now (also done when this object is collected or at exit)."""
        if self._remove_staging is not None:
            self._remove_staging()
