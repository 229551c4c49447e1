"""Agreement with math-verify's own test verdicts (136 pairs, ``tests/rewards/data``), through the harness
``benchmarks/bench_answer_agreement.py``, at least at the figures measured when it was written.

math-verify alone agrees on 136 raw and boxed ones (64 ``####``: it does not know GSM8K's marker). ``strict``
rejects raw predictions without an answer anchor by design.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gtpo_megatron.rewards import RewardPool

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_answer_agreement.py"
# The harness also runs boxed and #### completions in lenient mode (same figures: their answer is explicit).
MEASURED = {("raw", "lenient"): 136, ("raw", "strict"): 87, ("boxed", "strict"): 136, ("gsm8k", "strict"): 133}


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("bench_answer_agreement", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pool():
    # The slowest pair took 3.6 s on the shared 2-core machine under load; a generous limit keeps it from timing out.
    with RewardPool("math_verify", num_workers=2, timeout_s=30.0) as pool:
        yield pool


def test_pairs_are_the_documented_sample(harness) -> None:
    rows = harness.load_pairs()
    assert len(rows) == 136 and sum(r["expected"] for r in rows) == 117
    assert all(r["answer"] for r in rows)


@pytest.mark.parametrize(("feeding", "extraction"), sorted(MEASURED))
def test_agreement_with_math_verify_verdicts(harness, pool, feeding: str, extraction: str) -> None:
    rows = harness.load_pairs()
    verdicts, stats = harness.product_verdicts(pool, rows, feeding, extraction)
    assert stats["num_timeouts"] == stats["num_errors"] == 0, stats["errors"]
    assert len(harness.agreement(rows, verdicts)) >= MEASURED[(feeding, extraction)]
