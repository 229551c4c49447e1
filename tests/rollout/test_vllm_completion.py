"""``vllm_generation.to_completion``: the text of a completion is the completion its token ids are.

A stop string that ends inside a token: vLLM cuts its text at the string but keeps the whole token
(tiny-llama, seed 7, stop "ste": text "comed       dansuste", ids decoding to "comed       dansuster").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gtpo_megatron.rollout.vllm_generation import to_completion

PIECES = {18009: "comed", 5013: "      ", 44612: " dans", 5404: "uster", 2: "</s>"}


def _decode(token_ids, skip_special_tokens=False):
    return "".join(PIECES[t] for t in token_ids if not (skip_special_tokens and t == 2))


def _output(text, token_ids, stop_reason, finish_reason="stop"):
    return SimpleNamespace(
        text=text, token_ids=token_ids, stop_reason=stop_reason, finish_reason=finish_reason, logprobs=None
    )


def test_a_stop_string_inside_a_token_scores_the_decoded_ids():
    completion = to_completion(_output("comed       dansuste", [18009, 5013, 44612, 5404], "ste"), _decode)
    assert completion.text == "comed       dansuster"


@pytest.mark.parametrize(
    ("output", "text"),
    [
        (_output("comed      ", [18009, 5013, 2], None), "comed      "),  # EOS: vLLM's text (special token skipped)
        (_output("comed       dans", [18009, 5013, 44612], None, "length"), "comed       dans"),
    ],
)
def test_other_finishes_keep_vllms_text(output, text):
    assert to_completion(output, _decode).text == text
