"""The plugin on a caller's LoRA-wrapped GPTModel: 2 gloo ranks (TP=2), the caller's DDP and Megatron's schedule.

``plugin.attach_lora`` adds rank-4 adapters (alpha 8, all seven projections) to the caller's tiny-qwen2 before DDP;
random float64 adapters (``tests/helpers/lora_reference.py``) are copied in as TP shards. One pass of the per-token
loss form through ``get_forward_backward_func`` must give the float64 hand-written LoRA reference's loss and, on
every adapter shard, its gradient (the base weights get none); ``plugin.sync_weights`` must push the merged weights
``W + alpha / rank * B @ A`` and ``plugin.save_adapters`` a PEFT folder holding the adapters.
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron import plugin
from tests.adapter.megatron_helpers import TINY_QWEN2, load_hf_model, make_batch, reference_grads
from tests.helpers.dist_harness import run_distributed
from tests.helpers.lora_reference import add_lora, merged_hf_weights, random_adapters, shard
from tests.plugin.test_plugin_megatron import SPEC, RecordingEngine, _caller_model, _train_pass

pytestmark = pytest.mark.distributed

RANK, ALPHA = 4, 8.0
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
          "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
          "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}  # fmt: skip
GRAD_ATOL = 1e-5  # as tests/plugin/test_plugin_megatron.py


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    from safetensors.torch import load_file

    from gtpo_megatron.megatron_adapter.hf_conversion import global_named_parameters
    from gtpo_megatron.rollout.peft_adapter import tensor_key
    from tests.adapter.megatron_helpers import reference_token_logprobs

    groups = plugin.init_distributed(tp_size=2, pp_size=1)
    lora = plugin.LoRAConfig(rank=RANK, alpha=ALPHA)
    ddp, _, hf_config = _caller_model(TINY_QWEN2, groups, per_token=True, lora=lora)
    hf_model = load_hf_model(TINY_QWEN2).double()
    adapters = random_adapters(hf_model, ALL, RANK, seed=7)
    params = dict(global_named_parameters(ddp.module))
    with torch.no_grad():
        for (layer, proj), pair in adapters.items():
            for which, tensor in zip("AB", pair):
                name = f"decoder.layers.{layer}.{LINEAR[proj]}_lora.lora_{which}.{proj}"
                params[name].copy_(shard(tensor, proj, which, groups.tp_rank, 2))
    batch = make_batch(rows=4, seed=2)
    handles = add_lora(hf_model, adapters, ALPHA / RANK)
    with torch.no_grad():
        ref_logprobs, _ = reference_token_logprobs(hf_model, batch)
    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = (ref_logprobs.float() + noise) * batch.response_mask
    ref_loss, _ = reference_grads(hf_model, batch, loss_name="gtpo", aggregation=SPEC.aggregation)
    for handle in handles:
        handle.remove()
    store = _train_pass(ddp, groups, batch, per_token=True)
    loss = plugin.reduce_loss_metrics(store, group=None)["gtpo/loss"]
    assert abs(loss - ref_loss) <= 1e-6, (loss, ref_loss)
    worst = 0.0
    for name, param in params.items():
        if "_lora." not in name:
            assert not param.requires_grad, f"{name}: the base weights are frozen"
            continue
        which, proj = name.split(".lora_")[1].split(".")
        layer = int(name.split(".")[2])
        expected = shard(adapters[(layer, proj)]["AB".index(which)].grad, proj, which, groups.tp_rank, 2)
        worst = max(worst, (param.main_grad.double() - expected).abs().max().item())
    assert worst <= GRAD_ATOL, worst
    engine = RecordingEngine() if rank == 0 else None
    plugin.sync_weights(ddp, engine, hf_config=hf_config, groups=groups)
    num_bytes = plugin.save_adapters(ddp, out_dir, lora=lora, groups=groups, base_model=TINY_QWEN2)
    if rank == 0:
        merged = merged_hf_weights(hf_model, adapters, ALPHA / RANK)
        diffs = [(engine.tensors[name].double() - tensor).abs().max().item() for name, tensor in merged.items()]
        assert max(diffs) <= 1e-6, max(diffs)
        written = load_file(f"{out_dir}/adapter_model.safetensors")
        for (layer, proj), pair in adapters.items():
            for which, tensor in zip("AB", pair):
                assert torch.equal(written[tensor_key(layer, proj, which)], tensor.detach().float())
        assert num_bytes == sum(t.numel() * 4 for t in written.values())
    print(f"[plugin lora] loss {loss:.6f} vs {ref_loss:.6f}; max |adapter grad diff| {worst:.2e}")


def test_plugin_on_a_lora_wrapped_model(tmp_path):
    run_distributed(_worker, 2, str(tmp_path / "adapter"))
