"""No forward pass before the update and the KL reference policy, on 2 gloo ranks.

Fused vs two-pass (TP=2, then DP=2; tiny Qwen2, fp32): the same completions trained one step both ways.
* two-pass (the pre-fusion trainer): a no-grad pass at the sampling temperature (pi_old, mismatch), a second one at
  the entropy temperature (<H>_i), then delta_i, ``A_i - gamma <H>_i`` and ``lambda * delta_i`` on the host, and a
  loss without any entropy term;
* fused: raw advantages and lambda only; delta_i, the penalty and the mismatch come from the training forward.
Loss, every gradient shard (``main_grad``), the penalised advantages, the filter decisions, the entropy and the
mismatch sums agree to 1e-6.

KL reference (TP=2): ``FrozenReference`` (frozen copy of the initial weights) gives the policy's own log-probs at
step 1 (KL <= 1e-9), stays frozen while the policy trains, and the KL is positive after one update.

fp32 output layer (item 5): ``model.fp32_output_layer`` reaches ``build_gpt_model`` (trained and frozen policies).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gtpo_megatron.algorithm import build_loss_spec, compute_step_weights
from gtpo_megatron.config import RolloutConfig
from gtpo_megatron.ops import mismatch_sums, sequence_mean_entropy, sequence_terms
from tests.adapter.megatron_helpers import TINY_QWEN2, make_batch, model_section, settings_at
from tests.helpers.batches import algorithm_section
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS, GROUP = 8, 4
ROLLOUT = RolloutConfig(temperature=0.9)  # log-probs at T = 0.9, entropy at T_H = 1 (the fused op's two outputs)
ATOL = 1e-6


def _policy(groups, *, micro_batch_size=2):
    from gtpo_megatron.config import OptimConfig
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

    settings = settings_at(
        groups, model_section(TINY_QWEN2), optim=OptimConfig(lr=1e-3, clip_grad=1.0), micro_batch_size=micro_batch_size
    )
    return MegatronPolicy.from_pretrained(settings, groups=groups)


def _grads(policy) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in policy.model.parameters()]


def _local(batch, groups):
    share = ROWS // groups.dp_size
    return batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))


def _step_inputs(policy, groups):
    """A batch of two groups, its rewards, and the GTPO spec with a fixed tau that filters about half the rows."""
    batch = make_batch(rows=ROWS, seq_len=10, seed=5)
    batch.rollout_logprobs = -torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(2))
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    _, entropy = policy.compute_logprobs(batch, temperature=1.0)
    tau = float(sequence_mean_entropy(entropy, batch.response_mask).median())  # the median: some rows filtered
    cfg = algorithm_section(group_size=GROUP, entropy_filter="fixed", entropy_threshold=tau)
    return batch, rewards, cfg, build_loss_spec(cfg, ROLLOUT)


def _two_pass(policy, batch, rewards, cfg, spec, groups) -> dict:
    """The pre-fusion step: two no-grad passes, the entropy terms on the host, a loss without them."""
    local = _local(batch, groups)
    old_logprobs, _ = policy.compute_logprobs(local, temperature=spec.temperature)
    _, entropy = policy.compute_logprobs(local, temperature=cfg.entropy_temperature)
    weights = compute_step_weights(batch, rewards, cfg, loss_spec=spec)
    rows = slice(groups.dp_rank * local.num_sequences, (groups.dp_rank + 1) * local.num_sequences)
    terms = sequence_terms(
        sequence_mean_entropy(entropy, local.response_mask),
        weights.raw_advantages[rows],
        spec,
        keep_mask=weights.loss_row_mask[rows],
    )
    local.advantages = terms.advantages
    local.token_weights = weights.token_weights[rows] * terms.keep_mask.unsqueeze(-1)
    plain = dataclasses.replace(spec, entropy_filter="off", entropy_penalty=0.0)
    policy.zero_grad()
    metrics = policy.forward_backward(local, plain)
    mismatch = mismatch_sums(old_logprobs, local.rollout_logprobs, local.response_mask)
    return dict(metrics=metrics, grads=_grads(policy), terms=terms, mismatch=mismatch)


def _fused(policy, batch, rewards, cfg, spec, groups) -> dict:
    local = _local(batch, groups)
    weights = compute_step_weights(batch, rewards, cfg, loss_spec=spec)
    rows = slice(groups.dp_rank * local.num_sequences, (groups.dp_rank + 1) * local.num_sequences)
    local.advantages = weights.raw_advantages[rows]
    local.token_weights = weights.token_weights[rows]
    local.loss_row_mask = weights.loss_row_mask[rows]
    policy.zero_grad()
    return dict(metrics=policy.forward_backward(local, spec), grads=_grads(policy))


def _dp_sum(value: float, groups) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=groups.dp)
    return float(tensor)


def _check_fused_equals_two_pass(tp: int) -> None:
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=tp)
    policy = _policy(groups)
    batch, rewards, cfg, spec = _step_inputs(policy, groups)
    old = _two_pass(policy, batch, rewards, cfg, spec, groups)
    new = _fused(policy, batch, rewards, cfg, spec, groups)
    a, b = old["metrics"], new["metrics"]
    label = f"tp={tp} dp={groups.dp_size}"
    assert 0 < b["filtered_sequences"] < b["num_sequences"], (label, b)  # the filter acts on some rows
    assert abs(a["loss"] - b["loss"]) <= ATOL, (label, a["loss"], b["loss"])
    grad_diff = max((x - y).abs().max().item() for x, y in zip(old["grads"], new["grads"]))
    assert grad_diff <= ATOL, (label, grad_diff)
    terms = old["terms"]
    has_tokens = _local(batch, groups).response_mask.any(dim=-1)
    expected = {
        "advantage_abs_sum": _dp_sum(float(terms.advantages.abs()[has_tokens].sum()), groups),
        "seq_entropy_sum": _dp_sum(float(terms.seq_entropy[has_tokens].sum()), groups),
        "filtered_sequences": _dp_sum(float((~terms.keep_mask & has_tokens).sum()), groups),
        "mismatch_abs_logprob_diff": _dp_sum(float(old["mismatch"]["mismatch_abs_logprob_diff"]), groups),
        "mismatch_prob_ratio_err": _dp_sum(float(old["mismatch"]["mismatch_prob_ratio_err"]), groups),
    }
    worst = max(abs(b[k] - v) for k, v in expected.items())
    assert worst <= ATOL * b["num_tokens"], (label, {k: (b[k], v) for k, v in expected.items()})
    print(f"[fused vs two-pass] {label}: |loss diff| = {abs(a['loss'] - b['loss']):.2e}, "
          f"max |grad diff| = {grad_diff:.2e}, max |metric sum diff| = {worst:.2e}")  # fmt: skip


def _check_reference() -> None:
    from gtpo_megatron.megatron_adapter.reference import FrozenReference
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=2)
    policy = _policy(groups)
    reference = FrozenReference.from_pretrained(
        settings_at(groups, model_section(TINY_QWEN2), micro_batch_size=2), groups=groups
    )
    assert reference.policy.optimizer is None and not any(p.requires_grad for p in reference.policy.model.parameters())
    batch = make_batch(rows=ROWS, seq_len=10, seed=7)
    spec = build_loss_spec(algorithm_section("grpo", kl_coef=1e-6, kl_estimator="k3"), ROLLOUT)
    ref_logprobs, _ = reference.compute_logprobs(batch, temperature=spec.temperature)
    policy_logprobs, _ = policy.compute_logprobs(batch, temperature=spec.temperature)
    step1_diff = (ref_logprobs - policy_logprobs).abs().max().item()
    batch.ref_logprobs = ref_logprobs
    first = policy.train_step(batch, spec)
    assert step1_diff <= 1e-6 and 0 <= first["kl_mean"] <= 1e-9, (step1_diff, first["kl_mean"])
    frozen = [p.detach().clone() for p in reference.policy.model.parameters()]
    second = policy.train_step(batch, spec)  # the policy moved (lr 1e-3); the reference did not
    assert second["kl_mean"] > 1e-9, second["kl_mean"]
    assert all(torch.equal(a, b) for a, b in zip(frozen, reference.policy.model.parameters()))
    again, _ = reference.compute_logprobs(batch, temperature=spec.temperature)
    assert torch.equal(again, ref_logprobs)
    with pytest.raises(RuntimeError, match="frozen"):
        reference.policy.train_step(batch, spec)
    print(f"[KL reference] step 1: max |ref - policy logprob| = {step1_diff:.2e}, kl_mean = {first['kl_mean']:.2e}; "
          f"after one update: kl_mean = {second['kl_mean']:.2e}")  # fmt: skip


def _check_fp32_output_layer_wiring() -> None:
    """``model.fp32_output_layer`` reaches ``build_gpt_model`` for the policy and the reference (bf16 parameters)."""
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=2)
    for fp32 in (True, False):
        section = model_section(TINY_QWEN2, params_dtype="bfloat16", fp32_output_layer=fp32)
        for trainable in (True, False):
            policy = MegatronPolicy.from_pretrained(settings_at(groups, section), groups=groups, trainable=trainable)
            assert getattr(policy.model.output_layer, "computes_in_fp32", False) is fp32, (fp32, trainable)


def _worker(rank: int, world_size: int) -> None:
    _check_fused_equals_two_pass(tp=2)
    _check_fused_equals_two_pass(tp=1)  # DP = 2
    _check_reference()
    _check_fp32_output_layer_wiring()


def test_fused_objective_and_kl_reference():
    run_distributed(_worker, 2)
