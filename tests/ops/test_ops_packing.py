"""``PackedLayout``: packed row <-> padded rows, written-out cases, gradients and refusals."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.ops import PackedLayout

# Row of 10 columns: sequence 0 in columns 0-3, a gap at 4, sequence 1 in 5-6, sequence 2 in 7-9.
LAYOUT = PackedLayout.of([0, 5, 7, 10], [4, 2, 3])  # Megatron-LM appends the bin's end offset: dropped
PACKED = torch.arange(1.0, 11.0).reshape(1, 10)


def test_unpack_and_pack_written_out():
    rows = LAYOUT.unpack(PACKED)
    assert rows.tolist() == [[1, 2, 3, 4], [6, 7, 0, 0], [8, 9, 10, 0]]
    assert LAYOUT.pack(rows, 10).tolist() == [[1, 2, 3, 4, 0, 6, 7, 8, 9, 10]]  # the gap (column 4) is written as 0
    mask = LAYOUT.unpack(PACKED > 2)
    assert mask.dtype == torch.bool and mask.tolist() == [
        [False, False, True, True],
        [True, True] + [False] * 2,
        [True] * 3 + [False],
    ]


def test_gradients_flow_both_ways():
    leaf = PACKED.clone().requires_grad_(True)
    (LAYOUT.unpack(leaf) * torch.arange(12.0).reshape(3, 4)).sum().backward()
    # column 4 (gap) gets nothing; padded cells (1,2) (1,3) (2,3) read column 0 but are masked: no gradient
    assert leaf.grad.tolist() == [[0, 1, 2, 3, 0, 4, 5, 8, 9, 10]]
    rows = torch.ones(3, 4, requires_grad=True)
    (LAYOUT.pack(rows, 10) * PACKED).sum().backward()
    assert rows.grad.tolist() == [[1, 2, 3, 4], [6, 7, 0, 0], [8, 9, 10, 0]]


def test_input_is_not_modified_and_empty_layout():
    before = PACKED.clone()
    LAYOUT.unpack(PACKED)
    assert torch.equal(PACKED, before)
    empty = PackedLayout.of([0], [])
    assert empty.unpack(PACKED).shape == (0, 0) and empty.pack(torch.zeros(0, 0), 10).tolist() == [[0.0] * 10]


@pytest.mark.parametrize(
    "starts,lengths,match",
    [([0, 3], [4, 2], "overlap"), ([0, 5, 9], [4], "one start and one length"), ([-1], [2], ">= 0")],
)
def test_bad_layouts_are_refused(starts, lengths, match):
    with pytest.raises(ValueError, match=match):
        PackedLayout.of(starts, lengths)


def test_rows_and_widths_must_fit():
    with pytest.raises(ValueError, match="ends at column 10 but the packed row has 9"):
        LAYOUT.unpack(PACKED[:, :9])
    with pytest.raises(ValueError, match="one row"):
        LAYOUT.unpack(PACKED.expand(2, -1))
    with pytest.raises(ValueError, match=r"expected \[n, >= L\] = \[3, >= 4\]"):
        LAYOUT.pack(torch.zeros(2, 4), 10)
