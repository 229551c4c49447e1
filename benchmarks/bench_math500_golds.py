r"""How many MATH-500 reference answers the grader can read (not a test).

Usage: ``python benchmarks/bench_math500_golds.py [--data-dir DIR] [--timeout 10] [--show]``

Data: the ``math500`` test split through ``data.datasets.load_problems`` (``--data-dir``, else the project's data
folder: ``$GTPO_DATA_DIR``, see ``gtpo-data``). A gold is *readable* when

- ``parsed``: the grader parses it (``parse_span(reference_span(gold))``) to a SymPy value that is neither ``nan``
  nor complex infinity, and
- ``boxed`` / ``answer``: the gold graded against itself, written as ``\boxed{gold}`` and as
  ``<answer>gold</answer>``, scores correct without a grader error or timeout.

Runs against older checkouts too: ``PYTHONPATH=/path/to/checkout python benchmarks/bench_math500_golds.py``.
"""

from __future__ import annotations

import argparse

import sympy

from gtpo_megatron.data.datasets import load_problems
from gtpo_megatron.rewards.answer_text import reference_span
from gtpo_megatron.rewards.deadline import grading_deadline
from gtpo_megatron.rewards.equivalence import parse_span
from gtpo_megatron.rewards.math_answer import grade

FEEDINGS = {"boxed": "\\boxed{{{}}}", "answer": "<answer>{}</answer>"}


def parsed_ok(gold: str) -> bool:
    """Whether the grader reads ``gold`` as a SymPy value other than ``nan`` / complex infinity."""
    values = [p for p in parse_span(reference_span(gold)) if isinstance(p, (sympy.Basic, sympy.MatrixBase))]
    return any(not v.has(sympy.nan, sympy.zoo) for v in values)


def check(gold: str, timeout_s: float) -> dict[str, str]:
    """``{"parsed" | feeding: "ok" | "no" | "error: ..."}`` for one gold."""
    tests = {"parsed": lambda: parsed_ok(gold)}
    tests |= {name: (lambda f=form: grade(f.format(gold), gold).correct) for name, form in FEEDINGS.items()}
    outcome = {}
    for name, test in tests.items():
        try:
            with grading_deadline(timeout_s):
                outcome[name] = "ok" if test() else "no"
        except Exception as exc:  # noqa: BLE001 - every failure is a finding of this benchmark
            outcome[name] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per check")
    parser.add_argument("--show", action="store_true", help="print every gold that is not readable")
    args = parser.parse_args()
    golds = [p.answer for p in load_problems("math500", split="test", data_dir=args.data_dir)]
    outcomes = [check(gold, args.timeout) for gold in golds]
    columns = ["parsed", *FEEDINGS]
    for name in columns:
        errors = sum(o[name].startswith("error") for o in outcomes)
        print(f"{name:8} {sum(o[name] == 'ok' for o in outcomes):4}/{len(golds)} ok, {errors} grader errors")
    readable = sum(all(o[c] == "ok" for c in columns) for o in outcomes)
    print(f"readable {readable:4}/{len(golds)}")
    if args.show:
        for gold, outcome in zip(golds, outcomes, strict=True):
            if any(v != "ok" for v in outcome.values()):
                print(f"  {gold!r}: {outcome}")


if __name__ == "__main__":
    main()
