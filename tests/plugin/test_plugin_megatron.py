"""The plugin in a real Megatron-Core job: 2 gloo ranks, the caller's own DDP-wrapped GPTModel and Megatron's schedule.

For DP=2, TP=2 and PP=2 (tied embeddings across the two stages), both loss forms drive
``get_forward_backward_func()`` through ``plugin.make_forward_step``: the per-token form with
``calculate_per_token_loss=True`` (Megatron's ``finalize_model_grads`` divides by the all-reduced token count) and the
legacy form with ``plugin.loss_normalizer``. Every rank's gradient shard (``main_grad``) must equal the single-process
``transformers`` float64 reference gradient sliced the same way, and ``reduce_loss_metrics`` the reference loss.
Then ``plugin.sync_weights`` streams a TP=2 model into a recording engine on rank 0 (bit-equal to the HF checkpoint)
and refuses a model with a module the converter does not know, and a model that does not match the HF config.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron import plugin
from tests.adapter.megatron_helpers import (
    TINY_LLAMA,
    TINY_QWEN2,
    DictReader,
    load_hf_model,
    make_batch,
    reference_grads,
    reference_token_logprobs,
)
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS, MICRO_BATCH_SIZE = 8, 2
GRAD_ATOL = 1e-5  # fp32 gradients accumulated in different orders (TP splits, micro-batches, DP sums)
SPEC = plugin.LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


def _caller_model(path: str, groups, *, per_token: bool, lora: plugin.LoRAConfig | None = None):
    """A caller's GPTModel stage in Megatron DDP, with the HF weights (built with the package's own provider) and,
    given ``lora``, its adapters (``plugin.attach_lora``, before DDP)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.megatron_adapter import hf_loading, model
    from gtpo_megatron.megatron_adapter.external_model import model_geometry
    from gtpo_megatron.megatron_adapter.optimizer import wrap_ddp
    from tests.adapter.megatron_helpers import model_section, settings_at

    hf_config = AutoConfig.from_pretrained(resolve_model_path(path))
    settings = settings_at(groups, model_section(path))
    config = model.transformer_config_from_hf(hf_config, settings)
    config.calculate_per_token_loss = per_token  # before DDP: it fixes DDP's gradient scaling factor
    with plugin.cuda_to_cpu_mode():
        model_parallel_cuda_manual_seed(0)
        gpt = model.build_gpt_model(
            hf_config, config, padded_vocab_size=49152, pre_process=groups.is_first_pp_stage,
            post_process=groups.is_last_pp_stage,
        )  # fmt: skip
    geometry = model_geometry(gpt, hf_config, tp_size=groups.tp_size)
    hf_loading.load_hf_weights(gpt, resolve_model_path(path), geometry, tp_rank=groups.tp_rank)
    if lora is not None:
        plugin.attach_lora(gpt, lora, hf_config=hf_config, groups=groups)
    ddp = wrap_ddp(gpt, config, settings=settings)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, geometry, hf_config


def _micro_batches(local) -> list[plugin.MicroBatch]:
    seq_len = local.input_ids.shape[1]
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(seq_len).expand(MICRO_BATCH_SIZE, -1)
    return [
        plugin.MicroBatch(
            input_ids=local.input_ids[s],
            position_ids=positions,
            attention_mask=mask,
            response_mask=local.response_mask[s],
            token_weights=local.token_weights[s],
            advantages=local.advantages[s],
            old_logprobs=local.old_logprobs[s],
        )  # fmt: skip
        for s in (slice(i, i + MICRO_BATCH_SIZE) for i in range(0, local.num_sequences, MICRO_BATCH_SIZE))
    ]


def _train_pass(ddp, groups, local, *, per_token: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parts = _micro_batches(local)
    settings = plugin.forward_settings(
        SPEC, vocab_size=49152, tp_group=groups.tp if groups.tp_size > 1 else None, num_microbatches=len(parts),
        dp_size=groups.dp_size,
        normalizer=None if per_token else plugin.loss_normalizer([local.response_mask], SPEC, group=groups.dp),
    )  # fmt: skip
    ddp.zero_grad_buffer()
    with plugin.cuda_to_cpu_mode():
        return get_forward_backward_func()(
            forward_step_func=plugin.make_forward_step(settings, per_token=per_token), data_iterator=iter(parts),
            model=[ddp], num_microbatches=len(parts), seq_length=local.input_ids.shape[1],
            micro_batch_size=MICRO_BATCH_SIZE, forward_only=False,
        )  # fmt: skip


def _check_grads(ddp, geometry, groups, ref_grads, label: str) -> float:
    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading

    model, reader, worst = ddp.module, DictReader(ref_grads), 0.0
    for name, param in hf_conversion.global_named_parameters(model):
        mapping = hf_conversion.param_mapping(name, geometry)
        expected = hf_loading.shard_from_hf(mapping, reader, geometry, groups.tp_rank)
        diff = (param.main_grad - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= GRAD_ATOL, f"{label}: grad of {name} differs by {diff}"
    return worst


def _run_layout(path: str, tp: int, pp: int) -> None:
    groups = plugin.init_distributed(tp_size=tp, pp_size=pp)
    hf_model = load_hf_model(path)
    batch = make_batch(rows=ROWS, seed=tp * 10 + pp)
    with torch.no_grad():
        ref_logprobs, _ = reference_token_logprobs(hf_model, batch)
    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = (ref_logprobs.float() + noise) * batch.response_mask  # some ratios get clipped
    ref_loss, ref_grads = reference_grads(hf_model, batch, loss_name="gtpo", aggregation=SPEC.aggregation)
    share = ROWS // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    for per_token in (True, False):
        label = f"{path} tp={tp} pp={pp} dp={groups.dp_size} per_token={per_token}"
        ddp, geometry, _ = _caller_model(path, groups, per_token=per_token)
        store = _train_pass(ddp, groups, local, per_token=per_token)
        worst = _check_grads(ddp, geometry, groups, ref_grads, label)
        if groups.is_last_pp_stage:
            loss = plugin.reduce_loss_metrics(store, group=groups.dp)["gtpo/loss"]
            assert abs(loss - ref_loss) <= 1e-6, (label, loss, ref_loss)
        print(f"[plugin grad parity] {label}: max |grad diff| = {worst:.3e}")


class RecordingEngine:
    """A ``RolloutEngine`` stand-in for weight pushes: keeps every bucket's tensors."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.updates = 0

    def begin_weight_update(self):
        self.updates += 1

    def load_weight_bucket(self, bucket):
        self.tensors.update({name: tensor.clone() for name, tensor in bucket})

    def finish_weight_update(self):
        pass


def _check_sync(rank: int) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from gtpo_megatron.builtin_models import resolve_model_path

    groups = plugin.init_distributed(tp_size=2, pp_size=1)
    ddp, _, hf_config = _caller_model(TINY_LLAMA, groups, per_token=True)
    engine = RecordingEngine() if rank == 0 else None
    stats = plugin.sync_weights(ddp, engine, hf_config=hf_config, groups=groups, bucket_bytes=2**20)
    if rank == 0:
        original = load_file(f"{resolve_model_path(TINY_LLAMA)}/model.safetensors")
        assert set(engine.tensors) == set(original) and stats.num_buckets > 1
        assert all(torch.equal(engine.tensors[n], original[n]) for n in original)
    else:
        assert stats is None
    with pytest.raises(ValueError, match=r"share_embeddings_and_output_weights / tie_word_embeddings: model True"):
        plugin.sync_weights(ddp, engine, hf_config=AutoConfig.from_pretrained(resolve_model_path(TINY_QWEN2)),
                            groups=groups)  # fmt: skip
    ddp.module.decoder.layers[0].mlp.router = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"cannot convert \['decoder.layers.0.mlp.router.weight'\].*hf_conversion.py"):
        plugin.sync_weights(ddp, engine, hf_config=hf_config, groups=groups)


def _worker(rank: int, world_size: int) -> None:
    _run_layout(TINY_QWEN2, 1, 1)  # DP = 2
    _run_layout(TINY_QWEN2, 2, 1)
    _run_layout(TINY_LLAMA, 1, 2)  # tied embeddings split over two stages
    _check_sync(rank)


def test_plugin_forms_and_sync_in_a_megatron_job():
    run_distributed(_worker, 2)
