"""With GTPO's additions off, the plugin's loss is Megatron-LM's GRPO loss (``megatron/rl/rl_utils.py``
``calculate_grpo_loss`` + ``train_rl.py`` ``loss_func``), padded and packed, values and gradients.

The reference is written here from that documented formula, in Megatron-LM's own layout: log-probs ``[B, S-1]`` where
column ``p`` predicts token ``p+1``, ``loss_mask[:, 1:]``, advantages ``[B]`` broadcast over a row, or, for a
packed bin ``[1, N]``, advantage ``k`` on positions ``[seq_starts[k], seq_starts[k] + seq_lengths[k] - 1)``:

    r = exp(logp - logp_old),  is_w = min(exp(logp_old - logp_inference), is_truncation_coef)
    per-token loss = -is_w * min(r * A, clamp(r, 1 - eps_lower, 1 + eps_upper) * A)
                     + kl_beta * (exp(logp_ref - logp) - (logp_ref - logp) - 1)   (entropy_weight = 0)
    micro-batch loss = sum(loss * mask) / sum(mask)   (calculate_per_token_loss=False: mean of these over M)
                       or its sum and count           (calculate_per_token_loss=True: global token mean)

The plugin gets the same tensors shifted to its column convention (``pad(x, (1, 0))``, docs/megatron_lm.md), GTPO's
weights computed with conflicts and the entropy filter off and gamma 0 (the token weights are then the response
mask) times the importance weights, and ``LossSpec(loss_name="grpo", aggregation="token-mean", kl_coef=kl_beta,
kl_estimator="k3")`` with the same clip range.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gtpo_megatron import plugin
from tests.helpers.batches import algorithm_section
from tests.helpers.references import ref_logprobs_entropy

ROWS, SEQ, VOCAB, PADDED, GROUP = 8, 10, 13, 16, 4
EPS_LOWER, EPS_UPPER, KL_BETA, IS_TRUNCATION = 0.2, 0.28, 0.05, 1.5
LENGTHS = [10, 7, 5, 9, 10, 6, 8, 4]
PROMPT_LENGTHS = [3, 3, 3, 3, 2, 2, 2, 2]  # two groups of 4, prompt then generated tokens
GRPO_ALGORITHM = algorithm_section(
    "grpo", conflict_mode="off", conflict_amplification=1.0, entropy_filter="off", entropy_penalty=0.0
)
SPEC = plugin.LossSpec(
    loss_name="grpo", aggregation="token-mean", clip_eps_low=EPS_LOWER, clip_eps_high=EPS_UPPER, kl_coef=KL_BETA,
    kl_estimator="k3",
)  # fmt: skip


def _rollout():
    """Megatron-LM's unpacked batch: tokens, loss_mask [B, S] and [B, S-1] old/ref/inference log-probs."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    columns = torch.arange(SEQ)[None]
    loss_mask = (columns < torch.tensor(LENGTHS)[:, None]) & (columns >= torch.tensor(PROMPT_LENGTHS)[:, None])
    logits = torch.randn(ROWS, SEQ, PADDED, generator=gen, dtype=torch.float64).float()
    noise = lambda scale: scale * torch.randn(ROWS, SEQ - 1, generator=gen, dtype=torch.float64)  # noqa: E731
    current, _ = ref_logprobs_entropy(logits[:, :-1], tokens[:, 1:], vocab_size=VOCAB)
    old, ref, inference = current + noise(0.3), current + noise(0.2), current + noise(0.2)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25])
    grouped = rewards.double().reshape(-1, GROUP)  # Megatron-LM: (r - mean) / (population std + 1e-4)
    advantages = (grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, unbiased=False, keepdim=True) + 1e-4)
    return tokens, loss_mask, logits, old, ref, inference, rewards, advantages.reshape(-1)


def _megatron_lm_token_loss(current, old, ref, inference, advantages_per_token):
    """``calculate_grpo_loss``'s per-token loss (entropy_weight = 0), float64, Megatron-LM's layout."""
    ratios = torch.exp(current - old)
    clamped = ratios.clamp(1 - EPS_LOWER, 1 + EPS_UPPER)
    is_weights = torch.minimum(torch.exp(old - inference), torch.tensor(IS_TRUNCATION, dtype=torch.float64))
    ref_diff = ref - current
    kl = torch.exp(ref_diff) - ref_diff - 1
    return -is_weights * torch.minimum(ratios * advantages_per_token, clamped * advantages_per_token) + KL_BETA * kl


def _plugin_batch(tokens, response_mask, old, ref, inference, advantages, token_weights):
    """The same tensors in the plugin's convention (column s describes token s)."""
    shift = lambda x: F.pad(x, (1, 0)).float()  # noqa: E731
    is_weights = torch.minimum(torch.exp(old - inference), torch.tensor(IS_TRUNCATION, dtype=torch.float64))
    return plugin.MicroBatch(
        input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1), attention_mask=None,
        response_mask=response_mask, advantages=advantages.float(), token_weights=token_weights * shift(is_weights),
        old_logprobs=shift(old) * response_mask, ref_logprobs=shift(ref) * response_mask,
    )  # fmt: skip


def _gtpo_off_weights(tokens, response_mask, rewards, packed=None):
    weights = plugin.compute_gtpo_weights(
        tokens, response_mask, rewards, torch.full(rewards.shape, 5.0), GRPO_ALGORITHM, packed=packed
    )
    assert torch.equal(weights.token_weights, response_mask.float())  # GTPO's additions are off
    assert torch.equal(weights.advantages, weights.raw_advantages)  # gamma = 0: no entropy penalty
    return weights


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_padded_batch_matches_megatron_lm_grpo(micro_batches):
    tokens, loss_mask, logits, old, ref, inference, rewards, advantages = _rollout()
    weights = _gtpo_off_weights(tokens, loss_mask, rewards)
    batch = _plugin_batch(tokens, loss_mask, old, ref, inference, advantages, weights.token_weights)
    settings = plugin.forward_settings(SPEC, vocab_size=VOCAB)
    rows = ROWS // micro_batches
    per_token, sums, counts, mean_of_means = [], 0.0, 0, 0.0
    for m in range(micro_batches):
        part = slice(m * rows, (m + 1) * rows)
        leaf = logits[part].double().clone().requires_grad_(True)
        current, _ = ref_logprobs_entropy(leaf[:, :-1], tokens[part, 1:], vocab_size=VOCAB)
        token_loss = _megatron_lm_token_loss(current, old[part], ref[part], inference[part], advantages[part, None])
        mask = loss_mask[part, 1:].double()  # train_rl.forward_step: loss_mask[:, 1:]
        reference = (token_loss * mask).sum()
        reference.backward()
        ours_leaf = logits[part].clone().requires_grad_(True)
        loss_sum, count, _ = plugin.per_token_loss(ours_leaf, _slice(batch, part), settings)
        loss_sum.backward()
        assert count.item() == int(mask.sum()) and abs(loss_sum.item() - reference.item()) <= 1e-5
        assert torch.allclose(ours_leaf.grad, leaf.grad.float(), atol=1e-6, rtol=0), "gradient w.r.t. the logits"
        sums, counts = sums + reference.item(), counts + int(mask.sum())
        mean_of_means += reference.item() / mask.sum().item() / micro_batches
        per_token.append(loss_sum.item())
    # calculate_per_token_loss=True: the global token mean; False: the mean of micro-batch means (both Megatron-LM's)
    assert sum(per_token) / counts == pytest.approx(sums / counts, abs=1e-6)
    assert mean_of_means == pytest.approx(sum(p / c for p, c in zip(per_token, _counts(loss_mask, micro_batches)))
                                          / micro_batches, abs=1e-6)  # fmt: skip


def _slice(batch: plugin.MicroBatch, rows: slice) -> plugin.MicroBatch:
    return plugin.MicroBatch(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})


def _counts(loss_mask, micro_batches):
    rows = ROWS // micro_batches
    return [int(loss_mask[m * rows : (m + 1) * rows, 1:].sum()) for m in range(micro_batches)]


def _pack_bin(tokens, loss_mask, logits, old, ref, inference):
    """Megatron-LM's SequencePacker layout: each trajectory's real tokens at an aligned start (multiple of 4)."""
    starts, position = [], 0
    for length in LENGTHS:
        starts.append(position)
        position += -(-length // 4) * 4
    layout = plugin.PackedLayout.of([*starts, position], LENGTHS)  # with the trailing end offset, as Megatron-LM
    width = position
    pack = lambda x: layout.pack(x, width)  # noqa: E731
    next_token = lambda x: pack(F.pad(x, (1, 0)))[:, 1:]  # noqa: E731  [B, S-1] (predicts p+1) -> [1, N-1]
    packed_logits = torch.stack([pack(logits[..., v]) for v in range(PADDED)], dim=-1)
    return layout, pack(tokens), pack(loss_mask), packed_logits, next_token(old), next_token(ref), next_token(inference)


def test_packed_bin_matches_megatron_lm_grpo():
    tokens, loss_mask, logits, old, ref, inference, rewards, advantages = _rollout()
    layout, p_tokens, p_mask, p_logits, p_old, p_ref, p_inference = _pack_bin(tokens, loss_mask, logits, old, ref,
                                                                               inference)  # fmt: skip
    weights = _gtpo_off_weights(p_tokens, p_mask, rewards, packed=layout)
    leaf = p_logits.double().clone().requires_grad_(True)
    current, _ = ref_logprobs_entropy(leaf[:, :-1], p_tokens[:, 1:], vocab_size=VOCAB)
    packed_advantages = torch.zeros_like(current)  # calculate_grpo_loss's packed branch
    for k, (start, length) in enumerate(zip(layout.seq_starts, layout.seq_lengths)):
        packed_advantages[0, start : start + length - 1] = advantages[k]
    token_loss = _megatron_lm_token_loss(current, p_old, p_ref, p_inference, packed_advantages)
    mask = p_mask[:, 1:].double()
    reference = (token_loss * mask).sum()
    reference.backward()
    batch = _plugin_batch(p_tokens, p_mask, p_old, p_ref, p_inference, advantages, weights.token_weights)
    ours_leaf = p_logits.clone().requires_grad_(True)
    loss_sum, count, _ = plugin.per_token_loss(ours_leaf, batch, plugin.forward_settings(SPEC, vocab_size=VOCAB),
                                               packed=layout)  # fmt: skip
    loss_sum.backward()
    assert count.item() == int(mask.sum()) and abs(loss_sum.item() - reference.item()) <= 1e-5
    assert torch.allclose(ours_leaf.grad, leaf.grad.float(), atol=1e-6, rtol=0)


def test_amplification_one_alone_does_not_switch_conflicts_off():
    """Negative conflict tokens get lambda = 0 whatever the amplification: GRPO needs conflict_mode=off."""
    tokens, loss_mask, _, _, _, _, rewards, _ = _rollout()
    cfg = algorithm_section("grpo", conflict_mode="prefix_suffix", conflict_amplification=1.0, entropy_filter="off",
                            entropy_penalty=0.0)  # fmt: skip
    weights = plugin.compute_gtpo_weights(tokens, loss_mask, rewards, torch.zeros(ROWS), cfg)
    assert (weights.token_weights[loss_mask] == 0).any() and (weights.token_weights <= 1).all()
