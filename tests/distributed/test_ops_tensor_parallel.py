"""gloo TP=2 / TP=4 parity of the vocab-parallel op, and DP invariance of the loss with a global normaliser.

Every rank builds the full inputs from the same seed, slices its own vocabulary shard (or batch rows), and compares
its outputs and ITS gradient shard with the float64 single-process reference. One spawn per world size runs all
cases (each spawn costs seconds).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gtpo_megatron.ops import LossSpec, compute_normalizer, policy_loss, vocab_parallel_logprobs_entropy
from gtpo_megatron.parallel import (
    all_gather_rows,
    all_reduce_,
    any_rank,
    broadcast_,
    broadcast_object,
    global_mean,
    global_normalizer,
    reduce_metric_sums,
)
from gtpo_megatron.plan.layout import row_shard
from tests.helpers.dist_harness import run_distributed
from tests.helpers.references import ref_logprobs_entropy

pytestmark = pytest.mark.distributed
LOCAL_WIDTH = 6


def _literal_split(rank: int, group) -> None:
    # 10-token vocabulary split 5/5; p = w / 30; targets 4 (last column of shard 0) and 5 (first of shard 1),
    # both w = 5: logprob = ln(5/30) = -1.791759469; entropy = 2.182897521 nats (see tests/ops).
    full = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 4.0, 3.0, 2.0, 1.0]] * 2))
    shard = full[:, rank * 5 : (rank + 1) * 5].clone()
    logprobs, entropy = vocab_parallel_logprobs_entropy(shard, torch.tensor([4, 5]), tp_group=group)
    torch.testing.assert_close(logprobs, torch.full((2,), -1.791759469), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.full((2,), 2.182897521), atol=1e-6, rtol=0)


def _random_logits(world: int, vocab_size: int):
    """Seeded ``[3, 5, V]`` logits, targets (some on both sides of every shard boundary) and output weights."""
    gen = torch.Generator().manual_seed(17)
    full = 3 * torch.randn(3, 5, LOCAL_WIDTH * world, generator=gen)
    targets = torch.randint(0, vocab_size, (3, 5), generator=gen)
    boundaries = [min(b, vocab_size - 1) for r in range(1, world) for b in (r * LOCAL_WIDTH - 1, r * LOCAL_WIDTH)]
    targets.view(-1)[: len(boundaries)] = torch.tensor(boundaries)  # labels on both sides of shard boundaries
    return full, targets, torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)


def _check_against_reference(
    rank,
    group,
    full,
    targets,
    g_lp,
    g_h,
    *,
    vocab_size,
    temperature,
    chunk_size,
    entropy_temperature=None,
    entropy_requires_grad=True,
):
    """This rank's op outputs and gradient shard vs the float64 full-vocabulary reference; returns them."""
    cols = slice(rank * LOCAL_WIDTH, (rank + 1) * LOCAL_WIDTH)
    shard = full[..., cols].clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        shard,
        targets,
        tp_group=group,
        vocab_size=vocab_size,
        temperature=temperature,
        chunk_size=chunk_size,
        entropy_temperature=entropy_temperature,
        entropy_requires_grad=entropy_requires_grad,
        padded_vocab_size=full.shape[-1],
    )
    g_h = g_h if entropy_requires_grad else torch.zeros_like(g_h)
    (logprobs * g_lp + entropy * g_h).sum().backward()
    torch.testing.assert_close(shard.detach(), full[..., cols], rtol=0, atol=0, equal_nan=True)  # unmodified
    ref_full = full.double().requires_grad_()
    ref_lp, _ = ref_logprobs_entropy(ref_full, targets, vocab_size=vocab_size, temperature=temperature)
    _, ref_h = ref_logprobs_entropy(
        ref_full, targets, vocab_size=vocab_size, temperature=entropy_temperature or temperature
    )
    (ref_lp * g_lp.double() + ref_h * g_h.double()).sum().backward()
    # float32 vs float64 reference; values are O(10) nats, so allow 1e-6 relative on top of 1e-6 absolute.
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(shard.grad.double(), ref_full.grad[..., cols], atol=1e-6, rtol=1e-6)
    return logprobs.detach(), entropy.detach(), shard.grad


def _random_case(rank, world, group, vocab_size, temperature, chunk_size, entropy_temperature=None):
    full, targets, g_lp, g_h = _random_logits(world, vocab_size)
    return _check_against_reference(
        rank,
        group,
        full,
        targets,
        g_lp,
        g_h,
        vocab_size=vocab_size,
        temperature=temperature,
        chunk_size=chunk_size,
        entropy_temperature=entropy_temperature,
    )


def _masked_case(rank, world, group) -> None:
    """-inf logits (masked vocabulary entries): row (0, 0) has rank 1's whole shard -inf, row (0, 1) every shard but the
    last, scattered -inf elsewhere; garbage (+inf, NaN) in the padded columns. Values and gradient shards vs
    float64 (with and without the entropy gradient, chunked or not, temperatures 1, 0.5, 0.9 and a separate entropy
    temperature); the masked and padded columns get exactly 0 gradient."""
    vocab_size = LOCAL_WIDTH * world - 2
    full, targets, g_lp, g_h = _random_logits(world, vocab_size)
    full[torch.rand(full.shape, generator=torch.Generator().manual_seed(4)) < 0.2] = float("-inf")
    full[0, 0, LOCAL_WIDTH : 2 * LOCAL_WIDTH] = float("-inf")
    full[0, 1, : (world - 1) * LOCAL_WIDTH] = float("-inf")
    full[..., vocab_size], full[..., vocab_size + 1] = float("inf"), float("nan")
    targets = full[..., :vocab_size].argmax(dim=-1)  # finite target logits
    cols = slice(rank * LOCAL_WIDTH, (rank + 1) * LOCAL_WIDTH)
    cases = (
        (1.0, None, None, True),
        (0.5, 2, None, True),
        (0.9, 4, 1.4, True),
        (1.0, 3, None, False),
        (0.9, None, 1.0, False),
    )  # (temperature, chunk_size, entropy_temperature, entropy_requires_grad)
    for temperature, chunk_size, entropy_temperature, entropy_requires_grad in cases:
        _, _, grad = _check_against_reference(
            rank,
            group,
            full,
            targets,
            g_lp,
            g_h,
            vocab_size=vocab_size,
            temperature=temperature,
            chunk_size=chunk_size,
            entropy_temperature=entropy_temperature,
            entropy_requires_grad=entropy_requires_grad,
        )
        assert bool((grad[torch.isinf(full[..., cols]) | torch.isnan(full[..., cols])] == 0).all())


def _refusals(rank, world, group) -> None:
    """Rows without a softmax are refused on EVERY rank (the decision follows the all-reduced max), also when
    only one rank holds the +inf/NaN; afterwards the group still works (no rank left waiting in a collective)."""
    cases = [
        ((0, 1), slice(None), float("-inf"), r"row \(0, 1\) .* is -inf in all"),
        ((1, 0), slice(0, 1), float("inf"), r"row \(1, 0\) .* holds \+inf or NaN"),
        ((1, 1), slice((world - 1) * LOCAL_WIDTH, None), float("nan"), r"row \(1, 1\) .* holds \+inf or NaN"),
    ]
    for row, columns, value, message in cases:
        full = torch.randn(2, 2, LOCAL_WIDTH * world)
        full[row + (columns,)] = value
        shard = full[..., rank * LOCAL_WIDTH : (rank + 1) * LOCAL_WIDTH]
        with pytest.raises(ValueError, match=message):
            vocab_parallel_logprobs_entropy(shard, torch.zeros(2, 2, dtype=torch.long), tp_group=group)
    uniform, _ = vocab_parallel_logprobs_entropy(
        torch.zeros(1, LOCAL_WIDTH), torch.zeros(1, dtype=torch.long), tp_group=group
    )
    assert uniform.item() == pytest.approx(-math.log(LOCAL_WIDTH * world), abs=1e-6)


def _dp_invariance(rank, world, group) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = 4 * world
    mask = torch.arange(7)[None, :] < torch.randint(0, 8, (rows,), generator=gen)[:, None]
    policy = -3 * torch.rand(rows, 7, generator=gen)
    old = policy + 0.3 * torch.randn(rows, 7, generator=gen)
    adv = torch.randn(rows, generator=gen)
    weights = torch.tensor([0.0, 1.0, 2.0])[torch.randint(0, 3, (rows, 7), generator=gen)]
    mine = slice(rank * 4, rank * 4 + 4)
    for aggregation in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum"):
        outputs = []
        for part, normalizer in (
            (slice(None), compute_normalizer(mask, aggregation)),
            (mine, global_normalizer(local_normalizer(mask[mine], aggregation), group=group)),
        ):
            leaf = policy[part].clone().requires_grad_()
            loss, metrics = policy_loss(
                policy_logprobs=leaf,
                old_logprobs=old[part],
                advantages=adv[part],
                token_weights=weights[part],
                response_mask=mask[part],
                normalizer=normalizer,
                spec=LossSpec(loss_name="gtpo", aggregation=aggregation, clip_eps_low=0.2, clip_eps_high=0.2),
            )
            loss.backward()
            outputs.append((loss.detach(), metrics, leaf.grad))
        (full_loss, full_metrics, full_grad), (loss, metrics, grad) = outputs
        summed = reduce_metric_sums({"loss": loss, **metrics}, group=group)
        torch.testing.assert_close(summed.pop("loss"), full_loss, atol=1e-6, rtol=1e-6)
        for key, value in summed.items():
            torch.testing.assert_close(value, full_metrics[key], atol=1e-5, rtol=0)
        torch.testing.assert_close(grad, full_grad[mine], atol=1e-7, rtol=0)
    seq_entropy = torch.arange(rows, dtype=torch.float32)
    keep = torch.arange(rows) % 3 != 0
    expected = seq_entropy[keep].mean()
    torch.testing.assert_close(global_mean(seq_entropy[mine], group=group, mask=keep[mine]), expected)


def local_normalizer(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """This rank's count summed over two micro-batches of its rows (as a policy counts them)."""
    return compute_normalizer(mask[:2], aggregation) + compute_normalizer(mask[2:], aggregation)


def _trainer_collectives(rank, world, group) -> None:
    """The trainer's row gather, rollout broadcast and stop flag: every rank sees the same values."""
    full = torch.arange(3 * world, dtype=torch.float32) / 7  # each rank's [3] share, gathered back in rank order
    gathered = all_gather_rows(full[row_shard(3 * world, rank=rank, size=world)], group=group)
    assert torch.equal(gathered, full)
    # shares balanced by tokens are not contiguous: rank r holds rows r, r + world, r + 2 * world
    mine = torch.arange(rank, 3 * world, world)
    assert torch.equal(all_gather_rows(full[mine], group=group, rows=mine), full)
    assert broadcast_object({"step": 3} if rank == 0 else None, src=0, group=group) == {"step": 3}
    assert any_rank(rank == world - 1, group=group) is True and any_rank(False, group=group) is False
    empty = global_normalizer(compute_normalizer(torch.zeros(2, 3, dtype=torch.bool), "token-mean"), group=group)
    assert empty.item() == 0.0  # no rank has a response token: the policy skips the step
    values = torch.tensor([float(rank), -float(rank)])
    assert all_reduce_(values, op="max", group=group) is values  # in place
    assert values.tolist() == [world - 1.0, 0.0]
    totals = torch.full((2,), float(rank))
    assert broadcast_(totals, src=world - 1, group=group) is totals and totals.tolist() == [world - 1.0] * 2


def _all_cases(rank: int, world: int) -> None:
    torch.manual_seed(0)
    group = dist.group.WORLD
    if world == 2:
        _literal_split(rank, group)
    padded = LOCAL_WIDTH * world
    for vocab_size in (padded, padded - 1, padded - LOCAL_WIDTH - 1):  # the last case leaves one shard all padding
        for temperature, entropy_temperature in ((1.0, None), (0.7, None), (0.9, 1.0)):
            unchunked = _random_case(rank, world, group, vocab_size, temperature, None, entropy_temperature)
            chunked = _random_case(rank, world, group, vocab_size, temperature, 4, entropy_temperature)
            for a, b in zip(unchunked, chunked):
                torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    _masked_case(rank, world, group)
    _refusals(rank, world, group)
    _dp_invariance(rank, world, group)
    _trainer_collectives(rank, world, group)
    ones = torch.ones(2, 2, dtype=torch.bool)
    assert math.isfinite(float(global_normalizer(compute_normalizer(ones, "token-mean"), group=group)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_and_data_parallel_parity(world_size):
    run_distributed(_all_cases, world_size)
