r"""Agreement of the product's answer checking with math-verify's own test verdicts (not a test).

Usage: ``python benchmarks/bench_answer_agreement.py [--reward math_verify] [--workers 2] [--timeout 5]
[--show-disagreements]``

Data: ``tests/rewards/data/math_verify_pairs.jsonl`` (source and selection in ``tests/rewards/data/README.md``):
(gold, prediction, expected verdict) triples from math-verify's public tests, plus ``answer``, math-verify's
extracted answer string of the prediction (its sentence-ending full stop dropped for the wrapped forms). Each pair
is fed to the reward three ways:

- ``raw``: the prediction as the completion;
- ``boxed``: ``Therefore the answer is \boxed{<answer>}.``;
- ``gsm8k``: ``Step by step.`` then a ``#### <answer>`` line.

The reference is the gold as written in the test. A pair agrees when the reward's ``correct`` equals the expected
verdict; timeouts and errors disagree (and are counted). The table gives, per feeding, math-verify alone (its tests'
own ``parse`` + ``verify`` configuration, in this process) and the product's reward in the ``strict`` and
``lenient`` extraction modes, each through a ``RewardPool``. The raw predictions carry no answer anchor more often
than not, so ``strict`` rejects many of them by design; ``lenient`` is the like-for-like figure there.

The script also runs against an older checkout of the package whose pool has no extraction modes (one column,
``product``): ``PYTHONPATH=/path/to/old/checkout python benchmarks/bench_answer_agreement.py``.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from gtpo_megatron.rewards import RewardPool

DATA = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "data" / "math_verify_pairs.jsonl"
FEEDINGS = ("raw", "boxed", "gsm8k")


def load_pairs(path: Path = DATA) -> list[dict]:
    """The pairs, one dict per jsonl line (``gold``, ``pred``, ``expected``, ``answer``, ``source``)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completion(row: dict, feeding: str) -> str:
    """The completion text of ``row`` fed as ``feeding`` (module docstring)."""
    answer = row["answer"].replace("\n", " ").removesuffix(".")
    return {
        "raw": row["pred"],
        "boxed": f"Therefore the answer is \\boxed{{{answer}}}.",
        "gsm8k": f"Step by step.\n#### {answer}",
    }[feeding]


def math_verify_alone(rows: list[dict], feeding: str) -> list[bool]:
    """math-verify's verdicts with its tests' configuration (LaTeX boxed-first and expression extraction)."""
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return [bool(verify(parse(r["gold"], configs), parse(completion(r, feeding), configs))) for r in rows]


def product_verdicts(pool: RewardPool, rows: list[dict], feeding: str, extraction: str | None) -> tuple[list, dict]:
    """The reward's ``correct`` per pair (``None`` for a timeout or error) and the pool's stats."""
    kwargs = {} if extraction is None else {"extraction": extraction}
    results, stats = pool.score([completion(r, feeding) for r in rows], [r["gold"] for r in rows], **kwargs)
    failed = set(stats["failed_indices"])
    return [None if i in failed else r.correct for i, r in enumerate(results)], stats


def agreement(rows: list[dict], verdicts: list) -> list[int]:
    """Indices of the pairs whose verdict equals the expected one."""
    pairs = enumerate(zip(rows, verdicts, strict=True))
    return [i for i, (row, verdict) in pairs if verdict is not None and verdict == bool(row["expected"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward", default="math_verify")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer")
    parser.add_argument("--show-disagreements", action="store_true")
    args = parser.parse_args()
    rows = load_pairs()
    modes = ("strict", "lenient") if "extraction" in inspect.signature(RewardPool.score).parameters else (None,)
    columns = ["math-verify alone", *(f"product {m}" if m else "product" for m in modes)]
    print(f"{len(rows)} pairs from {DATA.name}; reward {args.reward!r}; agreement with the expected verdict")
    print(f"{'feeding':8} | " + " | ".join(f"{c:>18}" for c in columns) + " | timeouts/errors")
    with RewardPool(args.reward, num_workers=args.workers, timeout_s=args.timeout) as pool:
        for feeding in FEEDINGS:
            counts = [len(agreement(rows, math_verify_alone(rows, feeding)))]
            failures = []
            for mode in modes:
                verdicts, stats = product_verdicts(pool, rows, feeding, mode)
                agreed = set(agreement(rows, verdicts))
                counts.append(len(agreed))
                failures.append(f"{stats['num_timeouts']}/{stats['num_errors']}")
                if args.show_disagreements:
                    for i in sorted(set(range(len(rows))) - agreed):
                        print(
                            f"  {feeding}/{mode} #{i} expected {rows[i]['expected']} got {verdicts[i]}: "
                            f"gold {rows[i]['gold'][:60]!r} completion {completion(rows[i], feeding)[-80:]!r}"
                        )
            print(f"{feeding:8} | " + " | ".join(f"{c:>14}/{len(rows)}" for c in counts) + " | " + ", ".join(failures))


if __name__ == "__main__":
    main()
