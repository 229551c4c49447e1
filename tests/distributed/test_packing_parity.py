"""Packed token-budget micro-batches change no number (2 gloo ranks: TP=2, TP=2 with sequence parallelism, PP=2).

The reference is unpadded: every sequence alone in its micro-batch at its own length (the planner replaced by one
bin per row). Against it, the same tiny-llama policy trains on the batch packed under a budget (several sequences a
row, block-diagonal attention, per-sequence positions) and padded under a budget (each micro-batch right padded
to its longest). Lengths run from 3 to 200 tokens; one row has no response token. Loss, every rank's gradient
shard (``main_grad``) and the no-grad pass's log-probs and entropies must agree to fp32 rounding.
"""

from __future__ import annotations

import pytest

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_LLAMA, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed
LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)
LENGTHS = [200, 4, 57, 120, 9, 3, 181, 33]  # prompt 3: row 5 has no response token, row 1 one
GRAD_ATOL = 1e-6


def _skewed_batch():
    import torch

    from gtpo_megatron.batch import TrainBatch

    gen = torch.Generator().manual_seed(5)
    columns = torch.arange(max(LENGTHS))
    token_mask = columns[None] < torch.tensor(LENGTHS)[:, None]
    weights = torch.rand(token_mask.shape, generator=gen) * 2
    response_mask = token_mask & (columns[None] >= 3)
    return TrainBatch(
        input_ids=torch.randint(0, 49152, token_mask.shape, generator=gen) * token_mask,
        token_mask=token_mask,
        response_mask=response_mask,
        advantages=torch.randn(len(LENGTHS), generator=gen),
        token_weights=weights * response_mask,
    )


def _run(policy, batch):
    logprobs, entropy = policy.compute_logprobs(batch)
    metrics = policy.forward_backward(batch, LOSS)
    grads = {name: p.main_grad.clone() for name, p in policy.model.named_parameters()}
    policy.zero_grad()
    return logprobs, entropy, metrics, grads


def _packed_against_unpadded(rank: int, world_size: int, tp_size: int, pp_size: int, sequence_parallel: bool):
    import torch

    from gtpo_megatron.megatron_adapter import micro_batching
    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed
    from gtpo_megatron.plan.micro_batches import TokenBudget

    groups = init_distributed(tp_size=tp_size, pp_size=pp_size)
    settings = settings_at(groups, model_section(TINY_LLAMA), sequence_parallel=sequence_parallel,
                           token_budget=TokenBudget(max_tokens=400, packing=True))  # fmt: skip
    policy = MegatronPolicy.from_pretrained(settings, groups=groups)
    batch = _skewed_batch()
    planner = micro_batching.plan_micro_batches
    try:
        micro_batching.plan_micro_batches = lambda lengths, budget: [[row] for row in range(len(lengths))]
        reference = _run(policy, batch)
    finally:
        micro_batching.plan_micro_batches = planner
    assert reference[2]["perf/micro_batches"] == len(LENGTHS)
    for budget in (TokenBudget(max_tokens=400, packing=True), TokenBudget(max_tokens=400)):
        policy.token_budget = budget
        logprobs, entropy, metrics, grads = _run(policy, batch)
        assert metrics["perf/micro_batches"] == (2 if budget.packing else 3)  # [200 181 ...], [120 57 33], [9 4 3]
        torch.testing.assert_close(logprobs, reference[0], atol=1e-6, rtol=1e-6)  # |logprobs| ~ 11 nats
        torch.testing.assert_close(entropy, reference[1], atol=1e-5, rtol=0)
        loss, reference_loss = metrics["loss"], reference[2]["loss"]
        assert abs(loss - reference_loss) <= 1e-6 * max(1.0, abs(reference_loss)), (budget, loss, reference_loss)
        worst = max(float((grads[name] - grad).abs().max()) for name, grad in reference[3].items())
        print(f"rank {rank} {budget}: loss {loss!r} vs {reference_loss!r}, largest gradient difference {worst:.2e}")
        assert worst <= GRAD_ATOL, (budget, worst)
        assert any(float(grad.abs().max()) > 1e-3 for grad in grads.values())  # gradients that can differ


@pytest.mark.parametrize(
    ("tp_size", "pp_size", "sequence_parallel"),
    [(2, 1, False), (2, 1, True), (1, 2, False)],
    ids=["tp2", "tp2-sp", "pp2"],
)
def test_packing_parity_packed_and_padded_budgets_match_the_unpadded_reference(tp_size, pp_size, sequence_parallel):
    run_distributed(_packed_against_unpadded, 2, tp_size, pp_size, sequence_parallel)
