"""Entropy filter and penalty vs literal cases and the reference's if/else (docs/algorithm.md section 4)."""

from __future__ import annotations

import math

import pytest
import torch

from gtpo_megatron.ops import apply_entropy_penalty, entropy_keep_mask, sequence_mean_entropy
from tests.helpers.references import ref_keep

LN2 = math.log(2)


def test_sequence_mean_entropy_ignores_padding_and_empty_rows():
    entropy = torch.tensor([[1.0, 2.0, float("nan")], [float("nan"), 0.5, 1.5], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    assert sequence_mean_entropy(entropy, mask).tolist() == [1.5, 1.0, 0.0]


def test_paper_mode_literal():
    h = torch.tensor([0.2, LN2, 0.9, 1.5])
    # <H>_ini = 0.5 <= ln 2: drop H > ln 2 (a tie at ln 2 is kept).
    assert entropy_keep_mask(h, mode="paper", initial_entropy=0.5).tolist() == [True, True, False, False]
    # <H>_ini exactly ln 2 is a tie, which counts as "below": the filter is active.
    assert entropy_keep_mask(h, mode="paper", initial_entropy=LN2).tolist() == [True, True, False, False]
    # <H>_ini = 0.8 > ln 2: keep everything.
    assert entropy_keep_mask(h, mode="paper", initial_entropy=torch.tensor(0.8)).all()
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    assert entropy_keep_mask(h, mode="paper", initial_entropy=0.5, advantages=adv, only_negative=True).tolist() == [
        True,
        True,
        True,
        False,
    ]


@pytest.mark.parametrize("mode", ["paper", "fixed", "off"])
@pytest.mark.parametrize("only_negative", [False, True])
@pytest.mark.parametrize("initial", [0.3, 1.0])
def test_matches_reference(mode, only_negative, initial):
    h = torch.rand(40) * 1.5
    adv = torch.randn(40)
    got = entropy_keep_mask(
        h,
        mode=mode,
        threshold=0.7 if mode == "fixed" else LN2,
        initial_entropy=initial,
        advantages=adv,
        only_negative=only_negative,
    )
    want = ref_keep(
        h.tolist(),
        mode=mode,
        threshold=0.7 if mode == "fixed" else LN2,
        initial_entropy=initial,
        advantages=adv.tolist(),
        only_negative=only_negative,
    )
    assert got.tolist() == want


def test_penalty_and_errors():
    adv, h = torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.5, 2.0, 0.0])
    before = adv.clone()
    torch.testing.assert_close(apply_entropy_penalty(adv, h, 0.1), torch.tensor([0.95, -0.2, -1.0]))
    assert torch.equal(adv, before)
    with pytest.raises(ValueError, match="initial_entropy"):
        entropy_keep_mask(h, mode="paper")
    with pytest.raises(ValueError, match="choose one of"):
        entropy_keep_mask(h, mode="median")
    with pytest.raises(ValueError, match="advantages"):
        entropy_keep_mask(h, mode="fixed", only_negative=True)
    with pytest.raises(ValueError, match="gamma"):
        apply_entropy_penalty(adv, h, -1.0)
