"""The packed rollout rows (``rollout/exchange.py``): layout, round trip through a sum, refusals."""

from __future__ import annotations

import pytest
import torch

from gtpo_megatron.rollout.exchange import EngineTally, RowLayout, ScoredGroup, pack_rows, unpack_rows
from gtpo_megatron.rollout.types import Completion, PromptCompletions


def _group(prompt, completions, scores):
    return ScoredGroup(
        PromptCompletions(
            prompt_ids=prompt,
            completions=[
                Completion(ids, [-0.1 * (k + 1) for k in range(len(ids))], "text", reason)
                for ids, reason in completions
            ],
        ),
        scores=scores,
        correct=[s > 0 for s in scores],
        format_ok=[True, False],
    )


def test_rows_of_two_leaders_sum_to_the_whole_step():
    layout = RowLayout(max_prompt_len=4, max_tokens=3)
    assert layout.width == 6 + 4 + 3 * 3
    first = _group([7, 8], [([1, 2, 3], "length"), ([4], "stop")], [1.5, 0.0])
    second = _group([9, 10, 11, 12], [([5, 6], "stop"), ([49151], "stop")], [0.25, 10.0])
    rows_a = pack_rows({0: first}, num_groups=2, group_size=2, layout=layout)
    rows_b = pack_rows({1: second}, num_groups=2, group_size=2, layout=layout)
    first.completions.completions[0].token_versions = [4, 4, 5]  # a weight update after the second token
    rows_a = pack_rows({0: first}, num_groups=2, group_size=2, layout=layout)
    assert rows_a[0].tolist() == [2, 3, 1.5, 1, 1, 1, 7, 8, 0, 0, 1, 2, 3, -0.1, -0.2, -0.30000000000000004, 5, 5, 6]
    assert rows_a[2:].abs().sum() == 0 and rows_b[:2].abs().sum() == 0  # a leader writes only its own groups
    step = unpack_rows(rows_a + rows_b, group_size=2, layout=layout)
    assert [g.prompt_ids for g in step.groups] == [[7, 8], [9, 10, 11, 12]]
    assert [[c.token_ids for c in g.completions] for g in step.groups] == [[[1, 2, 3], [4]], [[5, 6], [49151]]]
    assert [c.finish_reason for g in step.groups for c in g.completions] == ["length", "stop", "stop", "stop"]
    assert step.groups[0].completions[0].rollout_logprobs == first.completions.completions[0].rollout_logprobs
    assert [c.token_versions for g in step.groups for c in g.completions] == [[4, 4, 5], None, None, None]
    assert step.scores == [1.5, 0.0, 0.25, 10.0] and step.lengths == [3, 1, 2, 1]
    assert step.correct == [True, False, True, True] and step.format_ok == [True, False, True, False]


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ({2: _group([1], [([1], "stop"), ([2], "stop")], [0, 0])}, "group slot 2 of 2"),
        ({0: _group([1, 2, 3, 4, 5], [([1], "stop"), ([2], "stop")], [0, 0])}, "prompt of 5 / completion of 1"),
        ({0: _group([1], [([1, 2, 3, 4], "stop"), ([2], "stop")], [0, 0])}, "completion of 4 tokens exceed 4 / 3"),
    ],
)
def test_rows_that_do_not_fit_are_refused(slots, message):
    with pytest.raises(ValueError, match=message):
        pack_rows(slots, num_groups=2, group_size=2, layout=RowLayout(max_prompt_len=4, max_tokens=3))


def test_engine_tally_is_a_row_of_counters():
    tally = EngineTally(tokens=12, generate_s=1.5, reward_s=0.25, busy_s=3, num_timeouts=1, num_errors=2, aborted=1)
    assert tally.as_tensor().tolist() == [12, 1.5, 0.25, 3, 1, 2, 1, 0] and tally.as_tensor().dtype == torch.float64
