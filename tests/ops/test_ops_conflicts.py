"""Conflict weights (docs/algorithm.md section 3) vs a hand-worked example and the loop reference."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import build_conflict_weights, conflict_normalizers
from tests.helpers.references import ref_conflict_weights

# Two positive (A > 0) and two negative completions of one prompt, different lengths, EOS id 9.
GROUP = [[5, 7, 8, 2, 9], [5, 7, 3, 9], [5, 6, 8, 2, 9], [5, 7, 1, 1, 4, 9]]
ADV = [1.0, 0.5, -0.5, -1.0]
# Raw conflicts from the front (same id at position k in a P+ and a P- completion):
#   c0: k0..k4 all (5 | 7 with c3 | 8,2,9 with c2)   -> prefix run 5
#   c1: k0, k1; k2 (3) has no negative match        -> prefix run 2
#   c2: k0; k1 (6) has no positive match            -> prefix run 1
#   c3: k0, k1; k2 (1) has no positive match        -> prefix run 2
# From each completion's end: last token 9 everywhere; then 2/2 and 8/8 shared by c0 and c2 only:
#   suffix runs c0: 3, c1: 1, c2: 3, c3: 1
EXPECTED_ONCE = [[2, 2, 2, 2, 2], [2, 2, 1, 2], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
EXPECTED_MULTIPLY = [[2, 2, 4, 4, 4], [2, 2, 1, 2], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]]
EXPECTED_ANY = [[2, 2, 2, 2, 2], [2, 2, 1, 1], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]]


def _pad(rows, width, *, left=False, pad_id=0):
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.long) if row else ids[i, cols]
        mask[i, cols] = True
    return ids, mask


def _unpad(weights, mask):
    return [weights[i][mask[i]].tolist() for i in range(weights.shape[0])]


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("pad_id", [0, 9])  # 9 == EOS: masks, not pad ids, define positions
def test_hand_worked_group(left, pad_id):
    ids, mask = _pad(GROUP, 8, left=left, pad_id=pad_id)
    adv = torch.tensor(ADV)
    for overlap, expected in (("once", EXPECTED_ONCE), ("multiply", EXPECTED_MULTIPLY)):
        weights = build_conflict_weights(ids, mask, adv, 4, overlap=overlap)
        assert _unpad(weights, mask) == expected
        assert torch.equal(weights[~mask], torch.zeros(int((~mask).sum())))
    any_position = build_conflict_weights(ids, mask, adv, 4, mode="any_position")
    assert _unpad(any_position, mask) == EXPECTED_ANY
    # normalize_by_conflicts parity: max(prefix run, suffix run) = 5, 2, 3, 2
    assert conflict_normalizers(ids, mask, adv, 4).tolist() == [5.0, 2.0, 3.0, 2.0]


def test_groups_never_cross_and_zero_advantage_is_neutral():
    other = [[5, 7, 8, 2, 9], [1, 2, 3], [5, 7, 8, 2, 9], []]  # group 2: A = 0, +1, -1, -1
    ids, mask = _pad(GROUP + other, 7)
    adv = torch.tensor(ADV + [0.0, 1.0, -1.0, -1.0])
    weights = build_conflict_weights(ids, mask, adv, 4)
    got = _unpad(weights, mask)
    assert got[:4] == EXPECTED_ONCE  # unchanged by the second group
    # group 2: only [1,2,3] is positive, nothing of it matches the negatives at its positions -> all 1
    assert got[4:] == [[1, 1, 1, 1, 1], [1, 1, 1], [1, 1, 1, 1, 1], []]


def test_one_sided_group_has_no_conflicts():
    ids, mask = _pad(GROUP, 6)
    weights = build_conflict_weights(ids, mask, torch.tensor([1.0, 1.0, 0.0, 2.0]), 4)
    assert torch.equal(weights, mask.float())


@pytest.mark.parametrize("mode", ["prefix_suffix", "any_position"])
@pytest.mark.parametrize("overlap", ["once", "multiply"])
def test_random_matches_reference(mode, overlap):
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 3, (int(n),), generator=gen).tolist() for n in torch.randint(0, 9, (24,), generator=gen)]
    adv = torch.randn(24, generator=gen).round()
    ids, mask = _pad(rows, 10, left=True)
    got = _unpad(build_conflict_weights(ids, mask, adv, 6, amplification=3.0, mode=mode, overlap=overlap), mask)
    want = ref_conflict_weights(rows, adv.tolist(), 6, amplification=3.0, mode=mode, overlap=overlap)
    assert got == want


def test_errors_and_inputs_untouched():
    ids, mask = _pad(GROUP, 6)
    adv = torch.tensor(ADV)
    snapshot = (ids.clone(), mask.clone(), adv.clone())
    build_conflict_weights(ids, mask, adv, 4)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (ids, mask, adv)))
    with pytest.raises(ValueError, match="group_size=3"):
        build_conflict_weights(ids, mask, adv, 3)
    with pytest.raises(ValueError, match="choose one of"):
        build_conflict_weights(ids, mask, adv, 4, mode="suffix")
    with pytest.raises(ValueError, match="bool"):
        build_conflict_weights(ids, mask.long(), adv, 4)
