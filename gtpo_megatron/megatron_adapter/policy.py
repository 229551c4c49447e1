"""``MegatronPolicy``: the facade the trainer calls (build, log-prob pass, optimizer step, weights, checkpoints).

One instance per process. It owns this rank's ``GPTModel`` stage (TP-sharded, wrapped in Megatron DDP), Megatron's
optimizer and LR schedule. Batches are ``batch.TrainBatch`` (this DP rank's rows, on CPU); ``micro_batching`` cuts
them into micro-batches (fixed rows, or under ``optim.max_tokens_per_micro_batch``, padded or packed), which run
through ``get_forward_backward_func()`` with ``forward_step.forward_step``.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtpo_megatron.batch import TrainBatch
from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading, micro_batching
from gtpo_megatron.megatron_adapter import model as model_lib
from gtpo_megatron.megatron_adapter.cpu_compat import cuda_to_cpu_mode, install_cpu_compat
from gtpo_megatron.megatron_adapter.forward_step import ForwardSettings, MicroBatch, forward_step
from gtpo_megatron.megatron_adapter.moe import router_losses as router_losses_lib
from gtpo_megatron.megatron_adapter.moe.metrics import RouterLoad
from gtpo_megatron.megatron_adapter.moe.routing_replay import RoutingReplay, check_replay_supported, recomputes_routers
from gtpo_megatron.megatron_adapter.optimizer import build_optimizer, optimizer_step, wrap_ddp
from gtpo_megatron.megatron_adapter.step_metrics import reduce_step_metrics
from gtpo_megatron.ops import LossSpec, compute_normalizer
from gtpo_megatron.parallel.collectives import all_reduce_, barrier, broadcast_, global_normalizer

if TYPE_CHECKING:
    from gtpo_megatron.config import ModelConfig
    from gtpo_megatron.megatron_adapter.settings import PolicySettings
    from gtpo_megatron.parallel.groups import ParallelGroups
    from gtpo_megatron.plan.micro_batches import TokenBudget

logger = logging.getLogger(__name__)


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


def _build_stage(
    hf_config,
    config,
    groups: ParallelGroups,
    *,
    padded_vocab_size: int,
    seed: int,
    fp32_output_layer: bool,
    backend: str,
):
    """This rank's ``GPTModel`` stage (``backend``'s layer spec), seeded from ``seed`` (torch, Megatron's TP RNG)."""
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
            fp32_output_layer=fp32_output_layer,
            backend=backend,
        )


def _padded_vocab(settings: PolicySettings, hf_config, *, padding_tp_size: int | None) -> int:
    """``V``: the Megatron checkpoint's embedding rows when starting from one, else the tokenizer's padded."""
    checkpoint = settings.model.megatron_checkpoint
    if checkpoint is not None:
        from gtpo_megatron.megatron_adapter.external_checkpoint import checkpoint_padded_vocab_size

        tp_size = math.lcm(settings.tp_size, padding_tp_size or settings.tp_size)
        return checkpoint_padded_vocab_size(checkpoint, vocab_size=hf_config.vocab_size, tp_size=tp_size)
    return settings.padded_vocab_size(hf_config.vocab_size, padding_tp_size=padding_tp_size)


def _load_initial_weights(gpt_model, model: ModelConfig, hf_path: str, geometry, *, tp_rank: int) -> None:
    """This rank's shard of the starting weights: ``model.megatron_checkpoint`` if set, else the HF folder."""
    if model.megatron_checkpoint is not None:
        from gtpo_megatron.megatron_adapter.external_checkpoint import load_model_weights

        load_model_weights(gpt_model, model.megatron_checkpoint)
    else:
        hf_loading.load_hf_weights(gpt_model, hf_path, geometry, tp_rank=tp_rank)


def _attach_lora(gpt_model, settings: PolicySettings, geometry) -> None:
    """Freeze the stage's base weights and add the ``model.lora`` adapters (``lora.attach_lora``), logged."""
    from gtpo_megatron.megatron_adapter.lora import attach_lora

    count = attach_lora(gpt_model, settings.model.lora, geometry, seed=settings.seed)
    logger.info("LoRA: %d adapter parameters on this rank train, the base weights are frozen", count)


class MegatronPolicy:
    """A Megatron-Core policy loaded from an HF checkpoint; see ``from_pretrained``.

    A frozen instance (``trainable=False``: the KL reference policy) has no DDP wrapper, optimizer or gradients;
    it only runs ``compute_logprobs``.
    """

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
        token_budget: TokenBudget | None = None,
        router_load: RouterLoad | None = None,
        routing_replay: RoutingReplay | None = None,
        router_losses: router_losses_lib.RouterLossWeights | None = None,
    ):
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.groups = groups
        self.hf_config = hf_config
        self.geometry = geometry
        self.hf_path = hf_path
        self.micro_batch_size = micro_batch_size
        self.token_budget = token_budget
        self.router_load = router_load  # mixture-of-experts models only
        self.routing_replay = routing_replay  # rollout.routing_replay=rollout only
        self.router_losses = router_losses  # trainable MoE models with a router loss coefficient > 0 only
        self.logprob_chunk_size = logprob_chunk_size
        self.device = next(self.model.parameters()).device
        self._step_end_rng: dict | None = None  # RNG states after the last train_step (or the loaded ones)

    @property
    def model(self):
        """This rank's unwrapped ``GPTModel`` stage."""
        return self.ddp_model if self.optimizer is None else self.ddp_model.module

    @classmethod
    def from_pretrained(
        cls,
        settings: PolicySettings,
        *,
        groups: ParallelGroups,
        padding_tp_size: int | None = None,
        trainable: bool = True,
    ) -> MegatronPolicy:
        """Build this rank's stage and load its shard of the starting weights.

        Weights from ``model.megatron_checkpoint`` (any layout) when set, else the HF folder, which always supplies
        the HF config; ``settings``: ``settings.policy_settings``. ``padding_tp_size`` pads as a run at that TP size
        did (default ``groups.tp_size``); ``trainable=False`` builds a frozen forward-only copy (the KL reference).

        Raises:
            ValueError: groups of another layout than the settings', heads or KV groups not divisible by
                ``tp_size`` without ``pad_attention_heads``, or an HF config / checkpoint the converter cannot map.
        """
        from megatron.core.distributed import finalize_model_grads
        from transformers import AutoConfig

        layout = (groups.tp_size, groups.pp_size, groups.ep_size)
        if layout != (settings.tp_size, settings.pp_size, settings.ep_size):
            raise ValueError(
                f"the process groups have (tp_size, pp_size, ep_size)={layout} but the policy settings "
                f"{(settings.tp_size, settings.pp_size, settings.ep_size)}; build both from parallel.tp_size/pp_size/"
                "ep_size"
            )
        hf_path = resolve_model_path(settings.model.name_or_path)
        install_cpu_compat()
        hf_config = AutoConfig.from_pretrained(hf_path)
        config = model_lib.transformer_config_from_hf(hf_config, settings, padding_tp_size=padding_tp_size)
        if settings.routing_replay:  # after the model's own refusals (an unsupported type is not "dense")
            check_replay_supported(hf_config)
        vocab_size = _padded_vocab(settings, hf_config, padding_tp_size=padding_tp_size)
        geometry = hf_conversion.ModelGeometry.from_hf(
            hf_config,
            padded_vocab_size=vocab_size,
            tp_size=groups.tp_size,
            pad_attention_heads=settings.model.pad_attention_heads,
            padding_tp_size=padding_tp_size,
        )
        _log_head_padding(geometry, settings.model.pad_attention_heads)
        gpt_model = _build_stage(
            hf_config,
            config,
            groups,
            padded_vocab_size=vocab_size,
            seed=settings.seed,
            fp32_output_layer=settings.model.fp32_output_layer,
            backend=model_lib.layer_spec_backend(settings.model),
        )
        _load_initial_weights(gpt_model, settings.model, hf_path, geometry, tp_rank=groups.tp_rank)
        if trainable and settings.model.lora.enabled:
            _attach_lora(gpt_model, settings, geometry)
        moe = geometry.moe
        router_load = router_losses = None
        if moe is not None and trainable:
            router_load = RouterLoad(gpt_model, num_layers=config.num_layers, num_experts=moe.num_experts)
            if settings.model.moe_aux_loss_coeff > 0 or settings.model.moe_z_loss_coeff > 0:
                router_losses = router_losses_lib.RouterLossWeights(gpt_model, recompute=recomputes_routers(config))
        routing_replay = None
        if settings.routing_replay:
            routing_replay = RoutingReplay(
                gpt_model, recompute=recomputes_routers(config), tp_rank=groups.tp_rank,
                tp_size=groups.tp_size, sequence_parallel=config.sequence_parallel,
            )  # fmt: skip
        optimizer = scheduler = None
        if trainable:
            gpt_model = wrap_ddp(gpt_model, config, settings=settings)
            config.finalize_model_grads_func = finalize_model_grads
            config.no_sync_func = gpt_model.no_sync
            optimizer, scheduler = build_optimizer(gpt_model, settings=settings, params_dtype=config.params_dtype)
        else:
            gpt_model.requires_grad_(False)
        return cls(
            ddp_model=gpt_model,
            optimizer=optimizer,
            scheduler=scheduler,
            groups=groups,
            hf_config=hf_config,
            geometry=geometry,
            hf_path=hf_path,
            micro_batch_size=settings.micro_batch_size,
            logprob_chunk_size=settings.logprob_chunk_size,
            token_budget=settings.token_budget,
            router_load=router_load,
            routing_replay=routing_replay,
            router_losses=router_losses,
        )

    # ----------------------------------------------------------------------------------------- micro-batches
    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """``batch`` on the device, cut as ``micro_batching`` says (token budget if set, else fixed rows).

        As many on every rank of the EP group (``equal_counts``). Collectives: with ``ep_size > 1`` one MAX
        all-reduce on EP.
        """
        cut = {
            "width_multiple": self.groups.tp_size if self.model.config.sequence_parallel else 1,
            "backend": self.model.layer_spec_backend,
            "device": self.device,
        }
        if self.token_budget is None:
            micro_batches = micro_batching.fixed_micro_batches(batch, self.micro_batch_size, **cut)
        else:
            micro_batches = micro_batching.budget_micro_batches(batch, self.token_budget, **cut)
        if self.groups.ep_size > 1:
            micro_batches = micro_batching.equal_counts(micro_batches, group=self.groups.ep)
        return micro_batches

    def _run_schedule(self, micro_batches: list[MicroBatch], settings: ForwardSettings, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if settings.routing_replay is not None:
            settings.routing_replay.begin_pass(training=not forward_only)
        with cuda_to_cpu_mode():
            store = get_forward_backward_func()(
                forward_step_func=partial(forward_step, settings=settings),
                data_iterator=iter(micro_batches),
                model=[self.ddp_model],
                num_microbatches=len(micro_batches),
                seq_length=micro_batches[0].input_ids.shape[1],  # read only without variable_seq_lengths
                micro_batch_size=micro_batches[0].input_ids.shape[0],
                forward_only=forward_only,
            )
        if settings.routing_replay is not None:
            settings.routing_replay.end_pass()
        return store

    def _settings(self, temperature: float, entropy_temperature: float | None, **loss_fields) -> ForwardSettings:
        return ForwardSettings(
            tp_group=self.groups.tp if self.groups.tp_size > 1 else None,
            vocab_size=self.geometry.vocab_size,
            temperature=temperature,
            entropy_temperature=entropy_temperature,
            chunk_size=self.logprob_chunk_size,
            routing_replay=self.routing_replay,
            router_losses=self.router_losses,
            **loss_fields,
        )

    # ---------------------------------------------------------------------------------------------- passes
    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, *, temperature: float = 1.0, entropy_temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad pass: ``(logprobs, entropy)`` of ``batch``, ``[B, S]`` fp32 nats on CPU, 0 off ``response_mask``.

        ``entropy_temperature`` None: ``temperature``. Identical on every rank of the TP x PP group.
        Collectives: the schedule's TP/PP traffic, then one ``[2, B, S]`` broadcast on the PP group.
        """
        self.ddp_model.eval()
        micro_batches = self._micro_batches(batch)
        settings = self._settings(temperature, entropy_temperature)
        store = self._run_schedule(micro_batches, settings, forward_only=True)
        both = torch.zeros(2, *batch.input_ids.shape, dtype=torch.float32, device=self.device)
        if self.groups.is_last_pp_stage:
            for micro_batch, values in zip(micro_batches, store):
                _scatter_rows(both, micro_batch.source_rows, torch.stack([values["logprobs"], values["entropy"]]))
        if self.groups.pp_size > 1:
            broadcast_(both, src=self.groups.pp_last_global_rank, group=self.groups.pp)
        self.ddp_model.train()
        return both[0].cpu(), both[1].cpu()

    def train_step(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """One optimizer step over all micro-batches of ``batch`` (this DP rank's rows).

        ``forward_backward`` then ``optimizer_step``; ``save_checkpoint`` stores the RNG states at its end.

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

        ``N`` is all-reduced over DP before the schedule (docs/architecture.md, "Loss scaling in Megatron's
        schedule"); every ``main_grad`` then holds the step objective's gradient, reduced over DP and tied copies.

        Returns:
            Metrics identical on every rank: ``loss``, ``normalizer``, the objective's sums, ``clip_frac``,
            ``ratio_mean``, ``kl_mean``, ``perf/*`` and for MoE models ``moe.metrics``'s; ``{"normalizer": 0.0}`` only
            when no DP rank has a response token.

        Raises:
            ValueError: ``batch.advantages`` is None, or the loss rejects its arguments.
            RuntimeError: a frozen (``trainable=False``) policy.
        """
        if self.optimizer is None:
            raise RuntimeError(
                "this MegatronPolicy is frozen (trainable=False, a KL reference): it only runs compute_logprobs"
            )
        if batch.advantages is None:
            raise ValueError("batch.advantages is None; fill TrainBatch.advantages before train_step")
        local = compute_normalizer(batch.loss_mask, loss.aggregation, max_response_length=loss.max_response_length)
        normalizer = global_normalizer(local, group=self.groups.dp).to(self.device)
        if float(normalizer) <= 0:
            logger.warning("train_step: no response tokens on any DP rank; step skipped")
            return {"normalizer": 0.0}
        micro_batches = self._micro_batches(batch)
        settings = self._settings(
            loss.temperature,
            loss.entropy_temperature,
            loss=loss,
            normalizer=normalizer,
            loss_scale=float(len(micro_batches) * self.groups.dp_size),
        )
        if self.router_losses is not None:
            self.router_losses.begin_pass(router_losses_lib.router_loss_factors(
                micro_batches, dp_group=self.groups.dp, dp_size=self.groups.dp_size
            ))  # fmt: skip
        store = self._run_schedule(micro_batches, settings, forward_only=False)
        if self.router_losses is not None:
            self.router_losses.end_pass()
        metrics = reduce_step_metrics(store, self.groups, device=self.device)
        metrics.update(micro_batching.micro_batch_metrics(micro_batches, group=self.groups.dp))
        world = dist.group.WORLD if self.groups.world_size > 1 else None
        if self.router_load is not None:
            metrics.update(self.router_load.metrics(
                world=world, num_micro_batches=len(micro_batches),
                stage_ranks=self.groups.world_size // self.groups.pp_size,
            ))  # fmt: skip
        if self.routing_replay is not None:
            matched, recorded = all_reduce_(self.routing_replay.agreement(), op="sum", group=world).tolist()
            if recorded > 0:
                metrics["mismatch/routing_agreement"] = matched / recorded
        metrics["normalizer"] = float(normalizer)
        return metrics

    def zero_grad(self) -> None:
        """Clear the DDP gradient buffers and the optimizer's gradients."""
        self.optimizer.zero_grad()
        self.ddp_model.zero_grad_buffer()

    def offload_train_state(self) -> None:
        """Free the DDP gradient buffers and move the optimizer's tensors to host memory (CUDA only).

        Megatron-Core's ``offload_grad_buffers`` (``main_grad`` values are lost) and ``offload_to_cpu`` (main params
        and Adam states). Call only after ``train_step``, before the next ``forward_backward``. No-op off CUDA; no
        collectives.
        """
        if self.device.type != "cuda":
            return
        self.ddp_model.offload_grad_buffers()
        self.optimizer.offload_to_cpu()

    def restore_train_state(self) -> None:
        """Undo ``offload_train_state``: grad buffers are reallocated *zeroed*, optimizer tensors move back.

        Call before any pass that touches the model. No-op off CUDA; no collectives.
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

    def shard_pieces(self):
        """``shard_stream.local_shard_pieces`` of this rank: ``(offers, (hf_name, part) -> view)``; no collectives."""
        from gtpo_megatron.megatron_adapter.shard_stream import local_shard_pieces

        return local_shard_pieces(self.model, self.geometry, self.groups)

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
        barrier(group=self.groups.mp)

    def save_checkpoint(self, path: str, trainer_state: dict) -> None:
        """``checkpoint.save_checkpoint`` of the state at the end of the last ``train_step``.

        Model, optimizer, LR schedule, ``trainer_state`` and the RNG states of the last step boundary.
        """
        from gtpo_megatron.megatron_adapter.checkpoint import save_checkpoint

        save_checkpoint(path, self, trainer_state, rng=self._step_end_rng)

    def load_checkpoint(self, path: str) -> dict:
        """``checkpoint.load_checkpoint`` into this policy (any TP/PP layout); returns the trainer state."""
        from gtpo_megatron.megatron_adapter.checkpoint import load_checkpoint, rng_state

        trainer_state = load_checkpoint(path, self)
        self._step_end_rng = rng_state()
        return trainer_state


def _scatter_rows(out_2BS: torch.Tensor, source_rows: tuple[int, ...], values_2bW: torch.Tensor) -> None:
    """Write a micro-batch's ``[2, b, W]`` values into rows ``source_rows`` of ``[2, B, S]`` (-1: dropped)."""
    keep = [k for k, row in enumerate(source_rows) if row >= 0]
    width = min(values_2bW.shape[-1], out_2BS.shape[-1])
    rows = torch.tensor([source_rows[k] for k in keep], device=out_2BS.device)
    out_2BS[:, rows, :width] = values_2bW[:, keep, :width].float()
