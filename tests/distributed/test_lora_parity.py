"""LoRA on the Megatron policy, 2 gloo ranks, vs a float64 hand-written LoRA on ``transformers``.

For TP=2, TP=2 with sequence parallelism and PP=2 (tiny-qwen2: qkv bias, untied; tiny-llama: tied embeddings),
with all seven projections and with a masked subset (q_proj, v_proj, down_proj: the fused linear_qkv half-adapted):
* at build (B = 0) the last stage's logits are bit-identical to the policy without adapters, and the KL
  reference's log-probs (``AdaptersOffReference``) once the adapters are nonzero equal that policy's (1e-5);
* with the reference's random adapters copied in, the logits agree (atol ``LOGITS_ATOL``), and one
  ``forward_backward`` gives each adapter shard's ``main_grad`` the reference gradient's shard (``GRAD_ATOL``);
  the base weights get no gradient and the optimizer holds the adapters only, contiguous, under the fused Adam;
* ``iter_hf_weights`` streams every HF tensor, the targeted projections merged (``W + alpha / rank * B @ A``).
"""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.config import LoRAConfig
from gtpo_megatron.megatron_adapter.optimizer import is_fused
from gtpo_megatron.ops import LossSpec, compute_normalizer, policy_loss
from gtpo_megatron.plan.architectures import architecture_from_hf_config
from gtpo_megatron.plan.memory import stage_lora_params
from tests.adapter.megatron_helpers import (
    LOGITS_ATOL,
    TINY_LLAMA,
    TINY_QWEN2,
    load_hf_model,
    make_batch,
    megatron_logits,
    megatron_named_params,
    model_section,
    reference_token_logprobs,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed
from tests.helpers.lora_reference import add_lora, merged_hf_weights, random_adapters, shard

pytestmark = pytest.mark.distributed

LOGPROB_ATOL = 1e-5  # as the dense parity tests
GRAD_ATOL = 1e-5  # as the dense parity tests: fp32 sums in different orders against the float64 reference
RANK, ALPHA = 4, 8.0
LINEAR = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
          "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
          "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}  # fmt: skip
LOSS = LossSpec(loss_name="gtpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


def _name(layer: int, proj: str, which: str) -> str:
    return f"decoder.layers.{layer}.{LINEAR[proj]}_lora.lora_{which}.{proj}"


def _build(path, groups, lora: LoRAConfig | None, sequence_parallel: bool):
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

    fields = {} if lora is None else {"lora": lora}
    settings = settings_at(groups, model_section(path, **fields), sequence_parallel=sequence_parallel)
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _reference(hf_model, adapters, batch):
    """Float64 loss gradient of every adapter tensor and the reference logits."""
    hf_model.double()
    handles = add_lora(hf_model, adapters, ALPHA / RANK)
    logprobs, _ = reference_token_logprobs(hf_model, batch)
    loss, _ = policy_loss(
        policy_logprobs=logprobs, old_logprobs=batch.old_logprobs.double(), advantages=batch.advantages.double(),
        token_weights=batch.token_weights.double(), response_mask=batch.response_mask,
        normalizer=compute_normalizer(batch.response_mask, LOSS.aggregation), spec=LOSS,
    )  # fmt: skip
    loss.backward()
    with torch.no_grad():
        logits = hf_model(_IDS).logits
    for handle in handles:
        handle.remove()
    return {key: (a.grad, b.grad) for key, (a, b) in adapters.items()}, logits


_IDS = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))


def _check_layout(path: str, tp: int, pp: int, sequence_parallel: bool, projections: tuple[str, ...]) -> None:
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    label = f"{path} tp={tp} pp={pp} sp={sequence_parallel} {projections}"
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=projections)
    policy = _build(path, groups, lora, sequence_parallel)
    base_policy = _build(path, groups, None, sequence_parallel)
    base = megatron_logits(base_policy, _IDS)
    lora_logits = megatron_logits(policy, _IDS)  # every stage runs the schedule; the last gets the logits
    if base is not None:
        assert torch.equal(lora_logits, base), f"{label}: B = 0 changed the logits"
    hf_model = load_hf_model(path)
    adapters = random_adapters(hf_model, projections, RANK, seed=tp * 10 + pp)
    params = dict(megatron_named_params(policy))
    with torch.no_grad():
        for (layer, proj), pair in adapters.items():
            for which, tensor in zip("AB", pair):
                if _name(layer, proj, which) in params:  # else another pipeline stage's layer
                    params[_name(layer, proj, which)].copy_(shard(tensor, proj, which, groups.tp_rank, tp))
    batch = make_batch(rows=4, seed=5)
    with torch.no_grad():
        old, _ = reference_token_logprobs(hf_model, batch)
    batch.old_logprobs = old.float() + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs *= batch.response_mask
    grads, ref_logits = _reference(hf_model, adapters, batch)
    logits = megatron_logits(policy, _IDS)
    if logits is not None:
        width = logits.shape[-1]
        columns = slice(groups.tp_rank * width, (groups.tp_rank + 1) * width)
        diff = (logits - ref_logits[..., columns]).abs().max().item()
        assert diff <= LOGITS_ATOL, f"{label}: logits differ by {diff}"
        print(f"[lora logits parity] {label}: max |logits diff| = {diff:.3e}")
    _check_reference(policy, base_policy, batch, label)
    policy.zero_grad()
    policy.forward_backward(batch, LOSS)
    _check_grads(policy, params, grads, label)
    _check_merged_stream(policy, hf_model, adapters, label)


def _check_reference(policy, base_policy, batch, label) -> None:
    """The KL reference of a LoRA policy (adapters off) is the base model, bit for bit; the adapters are back after."""
    from gtpo_megatron.megatron_adapter.reference import AdaptersOffReference

    before, _ = policy.compute_logprobs(batch)
    reference, _ = AdaptersOffReference(policy).compute_logprobs(batch)
    base = base_policy.compute_logprobs(batch)[0]
    # bit-identical at PP=2; at TP=2 within 1e-6 (fp32 noise between the two built models' logprob passes)
    torch.testing.assert_close(reference, base, atol=LOGPROB_ATOL, rtol=0, msg=f"{label}: adapters-off reference")
    assert not torch.equal(reference, before) and torch.equal(policy.compute_logprobs(batch)[0], before), label


def _check_grads(policy, params, grads, label) -> None:
    groups, worst = policy.groups, 0.0
    trainable = {name for name, param in params.items() if param.requires_grad}
    expected_names = {_name(layer, proj, which) for (layer, proj) in grads for which in "AB"}
    local = {name for name in expected_names if name in params}
    assert trainable == local and local, f"{label}: trainable {sorted(trainable ^ local)}"
    in_optimizer = sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"])
    assert in_optimizer == sum(params[name].numel() for name in local), f"{label}: optimizer holds base weights"
    # the fused CPU Adam ignores strides: every adapter contiguous, so the optimizer runs it (test_cpu_adam.py)
    assert all(params[name].is_contiguous() for name in local) and is_fused(policy.optimizer), label
    arch = architecture_from_hf_config(policy.hf_config.to_dict(), name=label)
    projections = tuple(sorted({proj for _, proj in grads}))
    planned = stage_lora_params(arch, rank=RANK, projections=projections, tp_size=groups.tp_size,
                                pp_size=groups.pp_size)  # fmt: skip
    assert in_optimizer == planned, f"{label}: {in_optimizer} adapter parameters, the planner counts {planned}"
    for (layer, proj), pair in grads.items():
        for which, grad in zip("AB", pair):
            name = _name(layer, proj, which)
            if name not in params:
                continue  # another pipeline stage's layer
            expected = shard(grad, proj, which, groups.tp_rank, groups.tp_size)
            diff = (params[name].main_grad.double() - expected).abs().max().item()
            worst = max(worst, diff)
            assert diff <= GRAD_ATOL, f"{label}: grad of {name} differs by {diff}"
    print(f"[lora grad parity] {label}: max |grad diff| = {worst:.3e}")


def _check_merged_stream(policy, hf_model, adapters, label) -> None:
    merged = merged_hf_weights(hf_model, adapters, ALPHA / RANK)
    state, seen = hf_model.state_dict(), set()
    for name, tensor in policy.iter_hf_weights():
        seen.add(name)
        diff = (tensor.double() - merged.get(name, state[name])).abs().max().item()
        assert diff <= 1e-6, f"{label}: streamed {name} differs from the merged reference by {diff}"
    assert set(merged) <= seen and "model.embed_tokens.weight" in seen, f"{label}: {sorted(set(merged) - seen)}"


def _worker(rank: int, world_size: int) -> None:
    all_linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    masked = ("q_proj", "v_proj", "down_proj")
    for tp, pp, sequence_parallel in ((1, 2, False), (2, 1, False), (2, 1, True)):
        for path in (TINY_QWEN2, TINY_LLAMA):
            for projections in (all_linear, masked):
                _check_layout(path, tp, pp, sequence_parallel, projections)


def test_lora_matches_float64_reference():
    run_distributed(_worker, 2)
