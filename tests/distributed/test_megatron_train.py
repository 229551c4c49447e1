"""Megatron training step on 2 gloo ranks vs the single-process ``transformers`` reference.

One spawn runs every layout in turn (DP=2, TP=2, PP=2 with tied embeddings), re-initialising Megatron's model
parallelism between them. For each layout and for 1 vs 4 micro-batches per rank:
* the gradient of every local parameter shard (``main_grad`` after Megatron's DP / embedding reductions) equals
  the HF model's gradient sliced with the same conversion (float32, atol 1e-5: fp32 sums in different orders);
* the reported step loss equals the reference loss and Megatron's global gradient norm the reference norm;
* ``compute_logprobs`` equals the float64 reference (atol 1e-5; entropy 5e-5) and is bit-identical to the training pass
  (``logprob_diff_max == 0``), entropy sums agree, and 5 extra padding columns change nothing;
then (TP=2) the non-finite guard skips a step with a NaN gradient and leaves the weights untouched, full
activation recompute gives identical gradients and bf16 parameters train; and (DP=2)
Megatron's distributed optimizer takes the same two steps as the plain one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import (
    TINY_LLAMA,
    TINY_QWEN2,
    DictReader,
    load_hf_model,
    make_batch,
    megatron_named_params,
    model_section,
    reference_grads,
    reference_token_logprobs,
    settings_at,
)
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS = 8
GRAD_ATOL = 1e-5  # fp32 gradients accumulated in different orders (TP splits, micro-batches, DP sums)
LOGPROB_ATOL = 1e-5  # fp32 model vs float64 log-softmax of the fp32 HF logits
ENTROPY_ATOL = 5e-5  # entropy ~10.8 nats is an fp32 sum over 49,152 columns: ~1e-6 relative summation error


def _check_grads(policy, ref_grads: dict[str, torch.Tensor], label: str) -> float:
    from gtpo_megatron.megatron_adapter import hf_conversion, hf_loading

    reader, worst = DictReader(ref_grads), 0.0
    for name, param in megatron_named_params(policy):
        mapping = hf_conversion.param_mapping(name, policy.geometry)
        expected = hf_loading.shard_from_hf(mapping, reader, policy.geometry, policy.groups.tp_rank)
        diff = (param.main_grad.float() - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= GRAD_ATOL, f"{label}: grad of {name} differs by {diff}"
    return worst


def _loss(aggregation: str) -> LossSpec:
    return LossSpec(loss_name="gtpo", aggregation=aggregation, clip_eps_low=0.2, clip_eps_high=0.2)


def _local_rows(batch, groups):
    share = ROWS // groups.dp_size
    return batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))


def _run_layout(path: str, tp: int, pp: int, aggregation: str) -> None:
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.optimizer import global_grad_norm
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp, pp_size=pp)
    hf_model = load_hf_model(path)
    batch = make_batch(rows=ROWS, seed=tp * 10 + pp)
    with torch.no_grad():
        ref_logprobs, ref_entropy = reference_token_logprobs(hf_model, batch)
    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1))
    batch.old_logprobs = (ref_logprobs.float() + noise) * batch.response_mask  # some ratios get clipped
    ref_loss, ref_grads = reference_grads(hf_model, batch, loss_name="gtpo", aggregation=aggregation)
    local = _local_rows(batch, groups)
    label = f"{path} tp={tp} pp={pp} dp={groups.dp_size}"
    model = model_section(path, make_vocab_size_divisible_by=1000)
    policy = MegatronPolicy.from_pretrained(
        settings_at(groups, model, optim=OptimConfig(lr=1e-3, clip_grad=1.0)), groups=groups
    )
    for micro_batch_size in (len(local.input_ids), len(local.input_ids) // 4):  # 1 vs 4 micro-batches
        policy.micro_batch_size = micro_batch_size
        policy.zero_grad()
        metrics = policy.forward_backward(local, _loss(aggregation))
        assert metrics["clipped_tokens"] > 0, "the test batch should exercise the clipped branch"
        assert abs(metrics["loss"] - ref_loss) <= 1e-6, (label, metrics["loss"], ref_loss)
        worst = _check_grads(policy, ref_grads, f"{label} mbs={micro_batch_size}")
        ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()
        norm = global_grad_norm(policy.optimizer)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, f"{label}: grad norm {norm} vs reference {ref_norm}"
        print(f"[grad parity] {label} micro_batch_size={micro_batch_size}: max |grad diff| = {worst:.3e}")
    _check_logprob_pass(policy, local, ref_logprobs, ref_entropy, groups, label)
    if tp == 2:
        _check_nonfinite_guard(policy, local)
        _check_recompute_and_bf16(path, groups, local)
    if groups.dp_size == 2:
        _check_removed_rows(policy, local, groups)
        _check_distributed_optimizer(path, groups, local)


def _check_removed_rows(policy, local, groups) -> None:
    """Rows whose ``loss_row_mask`` is False (skip_uniform_groups, overlong_filter) leave the loss and the
    normaliser: the step equals the one with their response tokens masked out by hand."""
    removed = local.select(slice(None))
    removed.loss_row_mask = torch.arange(local.num_sequences) != 0
    by_hand = local.select(slice(None))
    by_hand.response_mask = local.response_mask.clone()
    by_hand.response_mask[0] = False
    results = []
    for batch in (local, removed, by_hand):
        policy.zero_grad()
        metrics = policy.forward_backward(batch, _loss("token-mean"))
        results.append((metrics["normalizer"], [p.main_grad.clone() for p in policy.model.parameters()]))
    dropped = local.response_mask[0].sum().float().reshape(1)
    dist.all_reduce(dropped, group=groups.dp)  # row 0 of every DP rank
    assert results[1][0] == results[0][0] - dropped.item() == results[2][0]
    assert all(torch.equal(a, b) for a, b in zip(results[1][1], results[2][1]))


def _check_logprob_pass(policy, local, ref_logprobs, ref_entropy, groups, label) -> None:
    logprobs, entropy = policy.compute_logprobs(local)
    rows = local.input_ids.shape[0]
    start = groups.dp_rank * rows  # this rank's rows of the full-batch reference
    lp_diff = (logprobs.double() - ref_logprobs[start : start + rows]).abs().max().item()
    ent_diff = (entropy.double() - ref_entropy[start : start + rows]).abs().max().item()
    assert lp_diff <= LOGPROB_ATOL and ent_diff <= ENTROPY_ATOL, (label, lp_diff, ent_diff)
    assert bool((logprobs[~local.response_mask] == 0).all()) and bool((entropy[~local.response_mask] == 0).all())
    padded = local.select(slice(None))
    padded.input_ids = torch.nn.functional.pad(local.input_ids, (0, 5), value=7)
    padded.response_mask = torch.nn.functional.pad(local.response_mask, (0, 5), value=False)
    padded_logprobs, _ = policy.compute_logprobs(padded)  # other matmul shapes: a few fp32 ulps of ~10 nats
    pad_diff = (padded_logprobs[:, :-5] - logprobs).abs().max().item()
    assert pad_diff <= LOGPROB_ATOL, f"{label}: padding changed the log-probs by {pad_diff}"
    assert bool((padded_logprobs[:, -5:] == 0).all())
    policy.zero_grad()
    local.old_logprobs = logprobs
    metrics = policy.forward_backward(local, _loss("token-mean"))
    assert metrics["logprob_diff_max"] == 0.0, f"{label}: training pass differs from compute_logprobs"
    entropy_sum = entropy.sum().reshape(1)
    dist.all_reduce(entropy_sum, group=groups.dp)
    assert abs(metrics["entropy_sum"] - entropy_sum.item()) <= 1e-3, (metrics["entropy_sum"], entropy_sum)
    print(f"[logprob pass] {label}: |lp - ref| = {lp_diff:.3e}, |entropy - ref| = {ent_diff:.3e}")


def _check_nonfinite_guard(policy, local) -> None:
    from gtpo_megatron.megatron_adapter.optimizer import optimizer_step

    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    param = next(iter(policy.model.parameters()))
    if policy.groups.tp_rank == 0:
        param.main_grad.view(-1)[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        result = optimizer_step(policy.optimizer, policy.scheduler, policy.ddp_model)
    assert result["skipped"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    metrics = policy.train_step(local, _loss("token-mean"))
    assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0
    assert not all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())


def _check_recompute_and_bf16(path, groups, local) -> None:
    """Full activation recompute gives bit-identical gradients; bf16 parameters train and stay close to fp32."""
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

    loss = _loss("seq-mean-token-mean")
    grads = []
    for recompute in ("none", "full"):
        settings = settings_at(groups, model_section(path, recompute=recompute), micro_batch_size=2)
        policy = MegatronPolicy.from_pretrained(settings, groups=groups)
        policy.forward_backward(local, loss)
        grads.append([p.main_grad.clone() for p in policy.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "activation recompute changed the gradient"
    fp32_logprobs, _ = policy.compute_logprobs(local)
    bf16_settings = settings_at(groups, model_section(path, params_dtype="bfloat16"), micro_batch_size=2)
    bf16 = MegatronPolicy.from_pretrained(bf16_settings, groups=groups)
    logprobs, _ = bf16.compute_logprobs(local)
    assert logprobs.dtype == torch.float32
    assert (logprobs - fp32_logprobs).abs().max().item() < 0.05  # bf16 weights/activations, fp32 softmax
    assert all(bf16.train_step(local, loss)["skipped"] == 0.0 for _ in range(2))


def _check_distributed_optimizer(path, groups, local) -> None:
    """Megatron's distributed optimizer (GPU default; sharded over DP) takes the same steps as the plain one."""
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

    runs = []
    for distributed in (False, True):
        optim = OptimConfig(lr=1e-3, clip_grad=1.0)
        settings = settings_at(groups, model_section(TINY_QWEN2), optim=optim, micro_batch_size=2,
                               use_distributed_optimizer=distributed)  # fmt: skip
        policy = MegatronPolicy.from_pretrained(settings, groups=groups)
        steps = [policy.train_step(local, _loss("seq-mean-token-mean")) for _ in range(2)]
        runs.append([(m["loss"], m["grad_norm"]) for m in steps])
    for (loss, norm), (loss_d, norm_d) in zip(*runs):
        assert abs(loss - loss_d) <= 1e-6 and abs(norm - norm_d) <= 1e-5 * norm, runs


def _worker(rank: int, world_size: int) -> None:
    _run_layout(TINY_QWEN2, 1, 1, "seq-mean-token-mean")  # DP = 2
    _run_layout(TINY_QWEN2, 2, 1, "seq-mean-token-mean")
    _run_layout(TINY_LLAMA, 1, 2, "token-mean")  # tied embeddings split over two stages


def test_megatron_grads_match_single_process_reference():
    run_distributed(_worker, 2)
