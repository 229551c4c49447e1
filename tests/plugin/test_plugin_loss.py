"""The plugin's loss in Megatron's two conventions, one process with fake vocab-parallel logits (TP=1).

Megatron's arithmetic is replayed by hand as ``megatron_adapter/loss_forms.py`` derives it:
* per-token form, ``calculate_per_token_loss=True``: gradients summed over micro-batches and DP ranks, then divided
  by the summed counts (``finalize_model_grads``);
* per-token form, ``calculate_per_token_loss=False``: each micro-batch's sum divided by its count and by M, DP mean;
* legacy form: the returned loss divided by M, DP mean.
Every split must give the float64 reference gradient of the step objective (``tests/helpers/references.py``: a
token loop written independently of ``ops``), for each aggregation; packed rows must give the padded result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gtpo_megatron import plugin
from gtpo_megatron.ops import compute_normalizer
from tests.helpers.references import ref_logprobs_entropy, ref_policy_loss

ROWS, SEQ, VOCAB, PADDED, PROMPT = 8, 9, 11, 16, 2
LENGTHS = [9, 5, 3, 6, 9, 4, 2, 8]  # row 6: prompt only (no response token)
SPECS = {
    "token-mean": plugin.LossSpec(
        loss_name="grpo", aggregation="token-mean", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05
    ),
    "seq-mean-token-mean": plugin.LossSpec(
        loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2
    ),
    "seq-mean-token-sum": plugin.LossSpec(
        loss_name="dr_grpo", aggregation="seq-mean-token-sum", clip_eps_low=0.2, clip_eps_high=0.2,
        max_response_length=12,
    ),
}  # fmt: skip
SPLITS = [(1, 1), (1, 4), (2, 2), (4, 2)]  # (dp, micro-batches per rank)


def _inputs() -> tuple[torch.Tensor, plugin.MicroBatch]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, SEQ, PADDED, generator=gen, dtype=torch.float64).float()
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    columns = torch.arange(SEQ)
    response_mask = (columns[None] < torch.tensor(LENGTHS)[:, None]) & (columns[None] >= PROMPT)
    logprobs, _ = ref_logprobs_entropy(logits[:, :-1, :VOCAB], input_ids[:, 1:])
    logprobs = torch.nn.functional.pad(logprobs.float(), (1, 0))
    noise = lambda scale: scale * torch.randn(ROWS, SEQ, generator=gen)  # noqa: E731
    batch = plugin.MicroBatch(
        input_ids=input_ids,
        position_ids=columns.expand(ROWS, -1),
        attention_mask=None,
        response_mask=response_mask,
        token_weights=torch.rand(ROWS, SEQ, generator=gen) * 2 * response_mask,
        advantages=torch.randn(ROWS, generator=gen),
        old_logprobs=(logprobs + noise(0.3)) * response_mask,  # some ratios leave the clip range
        ref_logprobs=(logprobs + noise(0.2)) * response_mask,
    )
    return logits, batch


def _rows(batch: plugin.MicroBatch, rows: slice) -> plugin.MicroBatch:
    return plugin.MicroBatch(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})


def _reference(logits: torch.Tensor, batch: plugin.MicroBatch, spec, is_weights=None) -> tuple[float, torch.Tensor]:
    """float64 loss and gradient w.r.t. the logits of the whole step (response columns PROMPT.. of each row)."""
    leaf = logits.double().clone().requires_grad_(True)
    logprobs, _ = ref_logprobs_entropy(leaf[:, :-1], batch.input_ids[:, 1:], vocab_size=VOCAB)
    response = slice(PROMPT - 1, None)  # column s-1 of the shifted log-probs predicts token s
    lengths = batch.response_mask.sum(-1).tolist()
    normalizer = compute_normalizer(batch.response_mask, spec.aggregation, max_response_length=spec.max_response_length)
    loss = ref_policy_loss(
        logprobs[:, response], batch.old_logprobs[:, PROMPT:].double(), batch.advantages.double(),
        batch.token_weights[:, PROMPT:].double(), lengths, aggregation=spec.aggregation,
        normalizer=float(normalizer), clip_low=spec.clip_eps_low, clip_high=spec.clip_eps_high,
        ref_logprobs=batch.ref_logprobs[:, PROMPT:].double(), kl_coef=spec.kl_coef, kl_estimator=spec.kl_estimator,
        is_weights=None if is_weights is None else is_weights[:, PROMPT:],
    )  # fmt: skip
    loss.backward()
    return loss.item(), leaf.grad.float()


def _replay(logits, batch, spec, *, dp: int, micro: int, form: str):
    """Gradient w.r.t. the logits after Megatron's schedule, DDP and finalize_model_grads, and the stored metrics."""
    normalizer = compute_normalizer(batch.response_mask, spec.aggregation, max_response_length=spec.max_response_length)
    settings = plugin.forward_settings(
        spec, vocab_size=VOCAB, normalizer=normalizer, num_microbatches=micro, dp_size=dp
    )
    leaf = logits.clone().requires_grad_(True)
    per_rank, per_micro = ROWS // dp, ROWS // dp // micro
    summed, total_count, store = torch.zeros_like(leaf), 0, []
    for d in range(dp):
        rank_grad = torch.zeros_like(leaf)
        for m in range(micro):
            rows = slice(d * per_rank + m * per_micro, d * per_rank + (m + 1) * per_micro)
            if form == "legacy":
                loss, metrics = plugin.legacy_loss(leaf[rows], _rows(batch, rows), settings)
                loss = loss / micro  # the schedule
            else:
                loss, count, metrics = plugin.per_token_loss(leaf[rows], _rows(batch, rows), settings)
                assert count.dtype == torch.int32
                total_count += int(count)
                if form == "per_token_false":  # calculate_per_token_loss=False: the schedule divides
                    loss = loss / max(int(count), 1) / micro
            store.append(metrics)
            (grad,) = torch.autograd.grad(loss, leaf)
            rank_grad += grad
        summed += rank_grad if form == "per_token" else rank_grad / dp  # DDP: sum (per-token) or average
    grad = summed / total_count if form == "per_token" else summed  # finalize_model_grads(num_tokens)
    return grad, store


@pytest.mark.parametrize("aggregation", sorted(SPECS))
@pytest.mark.parametrize("dp,micro", SPLITS)
@pytest.mark.parametrize("form", ["per_token", "legacy"])
def test_both_forms_give_the_step_gradient_for_any_split(aggregation, dp, micro, form):
    logits, batch = _inputs()
    ref_loss, ref_grad = _reference(logits, batch, SPECS[aggregation])
    grad, store = _replay(logits, batch, SPECS[aggregation], dp=dp, micro=micro, form=form)
    assert torch.allclose(grad, ref_grad, atol=1e-7, rtol=0), (grad - ref_grad).abs().max()  # fp32 vs float64
    metrics = plugin.reduce_loss_metrics(store, group=None)
    assert metrics["gtpo/loss"] == pytest.approx(ref_loss, abs=1e-6)


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("form", ["per_token", "legacy"])
def test_off_policy_correction_from_behaviour_logprobs(correction, form):
    """The spec's correction and the micro-batch's ``rollout_logprobs`` (mu): w of pi_old / mu (decoupled PPO)."""
    logits, batch = _inputs()
    gen = torch.Generator().manual_seed(1)
    behaviour = (batch.old_logprobs + 0.6 * torch.randn(ROWS, SEQ, generator=gen)) * batch.response_mask
    batch = dataclasses.replace(batch, rollout_logprobs=behaviour)
    spec = dataclasses.replace(SPECS["seq-mean-token-mean"], off_policy_correction=correction, off_policy_cap=1.5)
    rho = torch.exp(batch.old_logprobs.double() - behaviour.double())
    weights = torch.where(rho > 1.5, 1.5 if correction == "tis" else 0.0, rho) * batch.response_mask
    assert 0 < int(((rho > 1.5) & batch.response_mask).sum()) < int(batch.response_mask.sum())  # the cap bites
    ref_loss, ref_grad = _reference(logits, batch, spec, is_weights=weights)
    grad, store = _replay(logits, batch, spec, dp=2, micro=2, form=form)
    assert torch.allclose(grad, ref_grad, atol=1e-7, rtol=0), (grad - ref_grad).abs().max()
    metrics = plugin.reduce_loss_metrics(store, group=None)
    assert metrics["gtpo/loss"] == pytest.approx(ref_loss, abs=1e-6)
    num_tokens = float(batch.response_mask.sum())
    assert metrics["gtpo/is_weight_mean"] == pytest.approx(float(weights.sum()) / num_tokens, rel=1e-5)
    assert metrics["gtpo/is_capped_frac"] == pytest.approx(
        float(((rho > 1.5) & batch.response_mask).sum()) / num_tokens
    )


def test_per_token_form_without_per_token_normalisation_is_a_micro_batch_mean():
    """calculate_per_token_loss=False: Megatron averages each micro-batch's own mean (Megatron-LM's GRPO too)."""
    logits, batch = _inputs()
    spec = SPECS["token-mean"]
    grad, _ = _replay(logits, batch, spec, dp=2, micro=2, form="per_token_false")
    expected = torch.zeros_like(logits)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):
        part = _rows(batch, rows)
        expected[rows] = _reference(logits[rows], part, spec)[1] / 4  # mean of 4 (M * D) micro-batch means
    assert torch.allclose(grad, expected, atol=1e-7, rtol=0)


@pytest.mark.parametrize("aggregation", list(SPECS))
def test_a_micro_batch_loss_row_mask_removes_its_rows(aggregation):
    # the record's one row mask: a row with loss_row_mask False gives what masking its response by hand gives
    logits, batch = _inputs()
    settings = plugin.forward_settings(SPECS[aggregation], vocab_size=VOCAB)
    row_mask = torch.arange(ROWS) != 1
    by_hand = dataclasses.replace(batch, response_mask=batch.response_mask & row_mask[:, None])
    results = []
    for micro in (dataclasses.replace(batch, loss_row_mask=row_mask), by_hand):
        leaf = logits.clone().requires_grad_(True)
        loss, count, metrics = plugin.per_token_loss(leaf, micro, settings)
        loss.backward()
        results.append((loss, count, metrics, leaf.grad))
    (loss, count, metrics, grad), (loss2, count2, metrics2, grad2) = results
    assert torch.equal(loss, loss2) and torch.equal(count, count2) and torch.equal(grad, grad2)
    assert grad[1].abs().sum() == 0 and all(torch.equal(metrics[k], metrics2[k]) for k in metrics)


def test_logprobs_path_equals_logits_path_and_metrics_are_pairs():
    logits, batch = _inputs()
    spec = SPECS["token-mean"]
    settings = plugin.forward_settings(spec, vocab_size=VOCAB)
    loss, count, metrics = plugin.per_token_loss(logits, batch, settings)
    logprobs, entropy = plugin.token_logprobs_entropy(logits, batch, settings)
    loss2, count2, metrics2 = plugin.per_token_loss_from_logprobs(logprobs, batch, settings, entropy=entropy)
    assert loss.item() == loss2.item() and count.item() == count2.item() == batch.response_mask.sum().item()
    assert set(metrics) == {
        "gtpo/loss", "gtpo/clip_frac", "gtpo/ratio_mean", "gtpo/entropy_mean", "gtpo/kl_mean", "gtpo/amplified_frac",
        "gtpo/zero_weight_frac",
    }  # fmt: skip
    for name, value in metrics.items():
        assert value.shape == (2,) and not value.requires_grad and torch.equal(value, metrics2[name]), name
    num_tokens = float(batch.response_mask.sum())
    assert metrics["gtpo/clip_frac"][1].item() == num_tokens
    kept = batch.response_mask & (batch.token_weights > 1)
    assert metrics["gtpo/amplified_frac"].tolist() == [float(kept.sum()), num_tokens]


def _packed_inputs(logits, batch):
    """All rows of ``batch`` (their real tokens) in one packed row with a gap of 2 columns after each sequence."""
    lengths = [max(n, 1) for n in LENGTHS]
    starts = [sum(lengths[:k]) + 2 * k for k in range(ROWS)]
    layout = plugin.PackedLayout.of(starts, lengths)
    width = starts[-1] + lengths[-1] + 1
    pack = lambda t: None if t is None else layout.pack(t, width)  # noqa: E731
    fields = ("input_ids", "position_ids", "response_mask", "token_weights", "old_logprobs", "ref_logprobs")
    packed_batch = dataclasses.replace(batch, **{k: pack(getattr(batch, k)) for k in fields})
    packed_logits = torch.stack([layout.pack(logits[..., v], width) for v in range(PADDED)], dim=-1)  # [1, N, V]
    return layout, packed_batch, packed_logits


@pytest.mark.parametrize("aggregation", sorted(SPECS))
def test_a_packed_row_gives_the_padded_loss_and_gradient(aggregation):
    logits, batch = _inputs()
    layout, packed_batch, packed_logits = _packed_inputs(logits, batch)
    settings = plugin.forward_settings(SPECS[aggregation], vocab_size=VOCAB)
    leaf = logits.clone().requires_grad_(True)
    loss, count, _ = plugin.per_token_loss(leaf, batch, settings)
    loss.backward()
    packed_leaf = packed_logits.clone().requires_grad_(True)
    packed_loss, packed_count, _ = plugin.per_token_loss(packed_leaf, packed_batch, settings, packed=layout)
    packed_loss.backward()
    assert count.item() == packed_count.item() and abs(loss.item() - packed_loss.item()) <= 1e-6
    unpacked_grad = torch.stack([layout.unpack(packed_leaf.grad[..., v]) for v in range(PADDED)], dim=-1)
    assert torch.allclose(unpacked_grad, leaf.grad[:, : unpacked_grad.shape[1]], atol=1e-7, rtol=0)
    legacy_settings = dataclasses.replace(settings, normalizer=count.float())
    legacy, _ = plugin.legacy_loss(packed_logits, packed_batch, legacy_settings, packed=layout)
    assert abs(legacy.item() - loss.item() / count.item()) <= 1e-6


class _FakeModel(torch.nn.Module):
    """A GPTModel stand-in: returns fixed logits for the rows it is given."""

    def __init__(self, logits: torch.Tensor, parallel_output: bool = True):
        super().__init__()
        self.logits, self.parallel_output = logits, parallel_output

    def forward(self, input_ids, position_ids, attention_mask):
        return self.logits[: input_ids.shape[0]]


def test_forward_step_factory_binds_the_chosen_form():
    logits, batch = _inputs()
    settings = plugin.forward_settings(SPECS["token-mean"], vocab_size=VOCAB, normalizer=torch.tensor(5.0))
    output, loss_fn = plugin.make_forward_step(settings)(iter([batch]), _FakeModel(logits))
    assert torch.equal(output, logits) and len(loss_fn(output)) == 3
    _, loss_fn = plugin.make_forward_step(settings, per_token=False)(iter([batch]), _FakeModel(logits))
    assert len(loss_fn(output)) == 2
    gathered = dataclasses.replace(settings, tp_group=object())  # a TP run with gathered logits: refused
    with pytest.raises(ValueError, match="parallel_output=True"):
        plugin.make_forward_step(gathered)(iter([batch]), _FakeModel(logits, parallel_output=False))


def test_refusals():
    logits, batch = _inputs()
    spec = SPECS["token-mean"]
    with pytest.raises(ValueError, match="needs settings.normalizer"):
        plugin.legacy_loss(logits, batch, plugin.forward_settings(spec, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="settings.loss is None"):
        plugin.per_token_loss(
            logits, batch, dataclasses.replace(plugin.forward_settings(spec, vocab_size=VOCAB), loss=None)
        )
    with pytest.raises(ValueError, match="num_microbatches=0"):
        plugin.forward_settings(spec, vocab_size=VOCAB, num_microbatches=0)
