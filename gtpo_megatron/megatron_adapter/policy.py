"""``MegatronPolicy``: the facade the trainer calls (build, log-prob pass, optimizer step, weights, checkpoints).

One instance per process. It owns this rank's ``GPTModel`` stage (TP-sharded, wrapped in Megatron DDP), Megatron's
optimizer and LR schedule. Batches are ``rollout.types.TrainBatch`` (this DP rank's rows, on CPU); they are cut
into micro-batches of ``micro_batch_size`` rows (the last one padded with fully masked rows, which contribute
nothing) and run through ``get_forward_backward_func()`` with ``forward_step.forward_step``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.megatron_adapter import hf_conversion
from gtpo_megatron.megatron_adapter import model as model_lib
from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode, install_cpu_compat
from gtpo_megatron.megatron_adapter.forward_step import LossSettings, MicroBatch, forward_step
from gtpo_megatron.megatron_adapter.optimizer import OptimSettings, build_optimizer, optimizer_step, wrap_ddp
from gtpo_megatron.megatron_adapter.step_metrics import reduce_step_metrics
from gtpo_megatron.ops import LossSpec
from gtpo_megatron.parallel.collectives import global_normalizer
from gtpo_megatron.plan.layout import padded_vocab_size
from gtpo_megatron.rollout.types import TrainBatch

if TYPE_CHECKING:
    from gtpo_megatron.config import ModelConfig
    from gtpo_megatron.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)
_PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _log_head_padding(geometry: hf_conversion.ModelGeometry, pad_attention_heads: bool) -> None:
    if geometry.num_pad_groups:
        logger.info(
            "head padding: %d -> %d KV groups, %d -> %d attention heads (tp_size=%d); padded heads are "
            "zero and stay zero",
            geometry.num_query_groups,
            geometry.padded_num_query_groups,
            geometry.num_heads,
            geometry.padded_num_heads,
            geometry.tp_size,
        )
    elif pad_attention_heads:
        logger.warning(
            "pad_attention_heads=True has no effect: num_key_value_heads=%d is divisible by tp_size=%d",
            geometry.num_query_groups,
            geometry.tp_size,
        )


def _params_dtype(model: ModelConfig) -> torch.dtype:
    if model.params_dtype not in _PARAMS_DTYPES:
        raise ValueError(
            f"model.params_dtype={model.params_dtype!r}: the Megatron policy trains in "
            f"{sorted(_PARAMS_DTYPES)}; set model.params_dtype=bfloat16 (or float32)"
        )
    return _PARAMS_DTYPES[model.params_dtype]


def _recompute_settings(model: ModelConfig) -> dict:
    """Megatron's recompute fields for ``model.recompute`` (full: every layer, one at a time)."""
    if model.recompute == "none":
        return {}
    full = model.recompute == "full"
    return {
        "recompute_granularity": model.recompute,
        "recompute_method": "uniform" if full else None,
        "recompute_num_layers": 1 if full else None,
    }


def _build_stage(hf_config, config, groups: ParallelGroups, *, padded_vocab_size: int, seed: int):
    """This rank's ``GPTModel`` stage, initialised from ``seed`` (torch and Megatron's model-parallel RNG)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    with cuda_to_cpu_mode():
        model_parallel_cuda_manual_seed(seed)
        return model_lib.build_gpt_model(
            hf_config,
            config,
            padded_vocab_size=padded_vocab_size,
            pre_process=groups.is_first_pp_stage,
            post_process=groups.is_last_pp_stage,
        )


class MegatronPolicy:
    """A Megatron-Core policy loaded from an HF checkpoint; see ``from_pretrained``."""

    def __init__(
        self,
        *,
        ddp_model,
        optimizer,
        scheduler,
        groups: ParallelGroups,
        hf_config,
        geometry,
        hf_path: str,
        micro_batch_size: int,
        logprob_chunk_size: int | None,
    ):
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.groups = groups
        self.hf_config = hf_config
        self.geometry = geometry
        self.hf_path = hf_path
        self.micro_batch_size = micro_batch_size
        self.logprob_chunk_size = logprob_chunk_size
        self.device = next(self.model.parameters()).device
        self._step_end_rng: dict | None = None  # RNG states after the last train_step (or the loaded ones)

    @property
    def model(self):
        """This rank's unwrapped ``GPTModel`` stage."""
        return self.ddp_model.module

    @classmethod
    def from_pretrained(
        cls,
        model: ModelConfig,
        *,
        groups: ParallelGroups,
        optim: OptimSettings | None = None,
        micro_batch_size: int = 1,
        logprob_chunk_size: int | None = None,
        seed: int = 1234,
        padding_tp_size: int | None = None,
    ) -> MegatronPolicy:
        """Build this rank's stage and load its shard of the HF checkpoint ``model.name_or_path``.

        Args:
            model: the model section: ``name_or_path`` (local HF folder with safetensors, or a ``builtin:`` name,
                see ``builtin_models.resolve_model_path``), ``params_dtype`` (``float32`` or ``bfloat16``; fp32
                main weights in the optimizer), ``make_vocab_size_divisible_by`` (vocabulary padding multiple,
                times ``tp_size``), ``recompute`` (Megatron activation recompute) and ``pad_attention_heads``
                (when the KV groups do not divide ``tp_size``, pad the Megatron model with all-zero KV groups up
                to the next multiple of ``tp_size``: exact for forward and training; HF export and weight
                streaming drop them; checkpoints keep them; see ``head_padding``).
            groups: the ``ParallelGroups`` of ``init_distributed`` (TP/PP sizes come from it).
            optim: Adam and LR-schedule settings (``build.optim_settings`` derives them from the config sections);
                None: ``OptimSettings()``.
            micro_batch_size: rows per micro-batch (>= 1).
            logprob_chunk_size: tokens per chunk in the vocab-parallel log-prob op (None = one chunk).
            seed: seeds torch and Megatron's model-parallel RNG tracker.
            padding_tp_size: pad the vocabulary (and, with ``pad_attention_heads``, the KV groups) as a run at
                this TP size did, so that its checkpoint loads at ``groups.tp_size`` (e.g. a TP=2 run exported
                in one process). Default: ``groups.tp_size``.

        Raises:
            ValueError: bad ``micro_batch_size``/``params_dtype``, heads or KV groups not divisible by ``tp_size``
                without ``pad_attention_heads``, or an HF config / checkpoint this converter cannot handle.
        """
        from megatron.core.distributed import finalize_model_grads
        from transformers import AutoConfig

        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        params_dtype = _params_dtype(model)
        optim = optim or OptimSettings()
        hf_path = resolve_model_path(model.name_or_path)
        install_cpu_compat()
        hf_config = AutoConfig.from_pretrained(hf_path)
        config = model_lib.transformer_config_from_hf(
            hf_config,
            tp_size=groups.tp_size,
            pp_size=groups.pp_size,
            params_dtype=params_dtype,
            pad_attention_heads=model.pad_attention_heads,
            padding_tp_size=padding_tp_size,
            **_recompute_settings(model),
        )
        vocab_size = padded_vocab_size(
            hf_config.vocab_size,
            make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
            tp_size=math.lcm(groups.tp_size, padding_tp_size or groups.tp_size),
        )
        geometry = hf_conversion.ModelGeometry.from_hf(
            hf_config,
            padded_vocab_size=vocab_size,
            tp_size=groups.tp_size,
            pad_attention_heads=model.pad_attention_heads,
            padding_tp_size=padding_tp_size,
        )
        _log_head_padding(geometry, model.pad_attention_heads)
        gpt_model = _build_stage(hf_config, config, groups, padded_vocab_size=vocab_size, seed=seed)
        hf_conversion.load_hf_weights(gpt_model, hf_path, geometry, tp_rank=groups.tp_rank)
        ddp_model = wrap_ddp(gpt_model, config, settings=optim)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp_model.no_sync
        optimizer, scheduler = build_optimizer(ddp_model, settings=optim, params_dtype=params_dtype)
        return cls(
            ddp_model=ddp_model,
            optimizer=optimizer,
            scheduler=scheduler,
            groups=groups,
            hf_config=hf_config,
            geometry=geometry,
            hf_path=hf_path,
            micro_batch_size=micro_batch_size,
            logprob_chunk_size=logprob_chunk_size,
        )

    # ----------------------------------------------------------------------------------------- micro-batches
    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """Cut ``batch`` into equal micro-batches (padding rows: all masks False, advantages 0)."""
        rows, seq_len = batch.input_ids.shape
        pad = (-rows) % self.micro_batch_size

        def prepare(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
            return t.to(self.device)

        tensors = {
            k: prepare(getattr(batch, k))
            for k in ("input_ids", "response_mask", "token_weights", "advantages", "old_logprobs", "ref_logprobs")
        }
        positions = torch.arange(seq_len, device=self.device).expand(self.micro_batch_size, -1)
        mask = model_lib.causal_attention_mask(seq_len, self.model.layer_spec_backend)
        mask = None if mask is None else mask.to(self.device)
        out = []
        for start in range(0, rows + pad, self.micro_batch_size):
            part = {k: None if v is None else v[start : start + self.micro_batch_size] for k, v in tensors.items()}
            out.append(MicroBatch(position_ids=positions, attention_mask=mask, **part))
        return out

    def _run_schedule(self, micro_batches: list[MicroBatch], settings: LossSettings, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with cuda_to_cpu_mode():
            return get_forward_backward_func()(
                forward_step_func=partial(forward_step, settings=settings),
                data_iterator=iter(micro_batches),
                model=[self.ddp_model],
                num_microbatches=len(micro_batches),
                seq_length=micro_batches[0].input_ids.shape[1],
                micro_batch_size=self.micro_batch_size,
                forward_only=forward_only,
            )

    def _settings(self, temperature: float, **loss_fields) -> LossSettings:
        return LossSettings(
            tp_group=self.groups.tp if self.groups.tp_size > 1 else None,
            vocab_size=self.geometry.vocab_size,
            temperature=temperature,
            chunk_size=self.logprob_chunk_size,
            **loss_fields,
        )

    # ---------------------------------------------------------------------------------------------- passes
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad pass over all micro-batches: per-token log pi and entropy of ``batch``.

        Returns:
            ``(logprobs, entropy)``: ``[B, S]`` fp32 on CPU, nats, 0 off ``response_mask`` (and in column 0),
            identical on every rank of this rank's TP x PP group.

        Collectives: the schedule's TP/PP traffic, then one broadcast of a ``[2, B, S]`` tensor on the PP group
        from the last stage.
        """
        self.ddp_model.eval()
        micro_batches = self._micro_batches(batch)
        store = self._run_schedule(micro_batches, self._settings(temperature), forward_only=True)
        rows, seq_len = batch.input_ids.shape
        if self.groups.is_last_pp_stage:
            both = torch.stack([torch.cat([d["logprobs"] for d in store]), torch.cat([d["entropy"] for d in store])])
            both = both[:, :rows].float().contiguous()
        else:
            both = torch.empty(2, rows, seq_len, dtype=torch.float32, device=self.device)
        if self.groups.pp_size > 1:
            dist.broadcast(both, src=self.groups.pp_last_global_rank, group=self.groups.pp)
        self.ddp_model.train()
        return both[0].cpu(), both[1].cpu()

    def train_step(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """One optimizer step over all micro-batches of ``batch`` (this DP rank's rows).

        ``forward_backward`` (arguments and batch fields documented there) followed by ``optimizer_step``; the
        RNG states at its end are what ``save_checkpoint`` stores.

        Returns:
            Metrics identical on every rank: those of ``forward_backward`` plus ``grad_norm``, ``lr``, ``skipped``.
        """
        from gtpo_megatron.megatron_adapter.checkpoint import rng_state

        metrics = self.forward_backward(batch, loss)
        if metrics.get("normalizer", 0.0) <= 0:
            self.zero_grad()
            metrics = dict(metrics, skipped=1.0)
        else:
            metrics.update(optimizer_step(self.optimizer, self.scheduler, self.ddp_model))
        self._step_end_rng = rng_state()
        return metrics

    def forward_backward(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """Accumulate the step's gradient into the DDP buffers (``param.main_grad``) without updating weights.

        The global normaliser ``N`` (``parallel.global_normalizer``: ``ops.compute_normalizer`` for
        ``loss.aggregation`` on this rank's rows, all-reduced over the DP group) is fixed before the schedule; see
        ``forward_step``'s docstring for how Megatron's per-micro-batch and DP averaging are cancelled. After the
        call every ``main_grad`` holds the gradient of the step objective, reduced over DP (and over the tied
        embedding copies). ``batch.advantages`` is required; ``token_weights=None`` means weight 1 on every
        response token; ``old_logprobs=None`` means one update per batch (ratio 1 with gradient);
        ``ref_logprobs`` feeds the optional KL term; ``loss.max_response_length`` selects Dr. GRPO's constant
        normaliser. Rows where ``batch.loss_row_mask`` is False are removed (``TrainBatch.loss_mask``): no loss term
        and no count in the normaliser (``ops.losses``).

        Returns:
            Metrics identical on every rank: ``loss`` (the step objective, summed over micro-batches and DP),
            ``normalizer``, the loss's sums/counts (``num_tokens``, ``clipped_tokens``, ...), the means
            ``clip_frac``, ``ratio_mean``, ``entropy_mean``, ``kl_mean``, and ``logprob_diff_max`` when
            ``old_logprobs`` is given. ``{"normalizer": 0.0}`` only when no DP rank has a response token.

        Raises:
            ValueError: ``batch.advantages`` is None, or the loss rejects its arguments.
        """
        if batch.advantages is None:
            raise ValueError("batch.advantages is None; fill TrainBatch.advantages before train_step")
        batch = dataclasses.replace(batch, response_mask=batch.loss_mask)  # removed rows leave loss and normaliser
        normalizer = global_normalizer(
            [batch.response_mask], loss.aggregation, group=self.groups.dp, max_response_length=loss.max_response_length
        ).to(self.device)
        if float(normalizer) <= 0:
            logger.warning("train_step: no response tokens on any DP rank; step skipped")
            return {"normalizer": 0.0}
        micro_batches = self._micro_batches(batch)
        settings = self._settings(
            loss.temperature,
            loss=loss,
            normalizer=normalizer,
            loss_scale=float(len(micro_batches) * self.groups.dp_size),
        )
        store = self._run_schedule(micro_batches, settings, forward_only=False)
        metrics = reduce_step_metrics(store, self.groups, device=self.device)
        metrics["normalizer"] = float(normalizer)
        return metrics

    def zero_grad(self) -> None:
        """Clear the DDP gradient buffers and the optimizer's gradients."""
        self.optimizer.zero_grad()
        self.ddp_model.zero_grad_buffer()

    def offload_train_state(self) -> None:
        """Free the DDP gradient buffers and move the optimizer's tensors to host memory (CUDA only).

        Megatron-Core's RL hooks: ``DistributedDataParallel.offload_grad_buffers`` shrinks every grad buffer's
        storage to 0 (``param.main_grad`` views stay valid objects; their values are lost), and
        ``MegatronOptimizer.offload_to_cpu`` moves the tensors of ``optimizer.param_groups`` (fp32 main params;
        with the plain fp32 optimizer these are the model parameters themselves) and the Adam states to CPU.
        Call only when the gradients are consumed: after ``train_step`` (``optimizer_step`` zeroes them) and
        before the next ``forward_backward``. No-op when the model is not on CUDA. Issues no collectives.
        """
        if self.device.type != "cuda":
            return
        self.ddp_model.offload_grad_buffers()
        self.optimizer.offload_to_cpu()

    def restore_train_state(self) -> None:
        """Undo ``offload_train_state``: grad buffers are reallocated *zeroed*, optimizer tensors move back.

        Call before any pass that touches the model (``compute_logprobs``, ``train_step``). No-op when the model
        is not on CUDA. Issues no collectives.
        """
        if self.device.type != "cuda":
            return
        self.ddp_model.restore_grad_buffers()
        self.optimizer.restore_from_cpu()

    # ----------------------------------------------------------------------------------- weights / checkpoints
    def iter_hf_weights(self):
        """``hf_stream.iter_hf_weights`` on this policy (every TP x PP rank must drain it)."""
        from gtpo_megatron.megatron_adapter.hf_stream import iter_hf_weights

        return iter_hf_weights(self.model, self.geometry, self.groups)

    def export_hf(self, out_dir: str) -> None:
        """Write an HF folder (safetensors, config, tokenizer) that ``transformers`` and vLLM load.

        Global rank 0 writes, every rank must call. Ends with a barrier on the model-parallel group.
        """
        from gtpo_megatron.megatron_adapter.hf_export import write_hf_folder

        write_hf_folder(
            self.iter_hf_weights(),
            out_dir,
            hf_config=self.hf_config,
            tokenizer_source=self.hf_path,
            write=self.groups.rank == 0,
        )
        dist.barrier(group=self.groups.mp)

    def save_checkpoint(self, path: str, trainer_state: dict) -> None:
        """``checkpoint.save_checkpoint`` of the state at the end of the last ``train_step``.

        Model, optimizer, LR schedule, ``trainer_state`` and the RNG states taken at the end of that ``train_step``
        (or by the last ``load_checkpoint``), so that a save after an aborted step stores the step boundary's state.
        """
        from gtpo_megatron.megatron_adapter.checkpoint import save_checkpoint

        save_checkpoint(path, self, trainer_state, rng=self._step_end_rng)

    def load_checkpoint(self, path: str) -> dict:
        """``checkpoint.load_checkpoint`` into this policy (any TP/PP layout); returns the trainer state."""
        from gtpo_megatron.megatron_adapter.checkpoint import load_checkpoint, rng_state

        trainer_state = load_checkpoint(path, self)
        self._step_end_rng = rng_state()
        return trainer_state
