"""OpenR1-Math-220k (``open-r1/OpenR1-Math-220k``, config ``default``): DeepSeek-R1 math traces as a training set.

Source ``openr1-math``; local file ``openr1-math/train.jsonl`` (``gtpo-data openr1-math`` keeps the fields below).
A row maps to a :class:`Problem` as ``uuid`` -> id, ``problem`` -> question, ``answer`` -> answer (the reference
final answer; ``solution`` and the ``generations`` traces are not used). A row is dropped, and counted by reason
(:data:`DROP_REASONS`; the loader logs the counts), when its answer cannot be used as a verified reference:

- ``no_final_answer``: ``question_type`` is ``proof``, or the answer is empty, ``proof`` or ``notfound``;
- ``unverified``: no generation of the row was judged to reach that answer, neither by math-verify
  (``correctness_math_verify``) nor by the Llama judge (``correctness_llama``, may be null);
- ``unparseable_answer``: math-verify reads no answer from it (``rewards.equivalence.parse_span``, about 1 ms a
  row, bounded by :data:`PARSE_TIMEOUT_S`): every completion would score 0 against it.
"""

from __future__ import annotations

from typing import Any

from gtpo_megatron.data.types import Problem

OPENR1_MATH = "openr1-math"
FIELDS = ("uuid", "problem", "answer", "question_type", "correctness_math_verify", "correctness_llama")
"""The row fields the loader reads (and ``gtpo-data`` keeps)."""
DROP_REASONS = ("no_final_answer", "unverified", "unparseable_answer")
PARSE_TIMEOUT_S = 5.0
_NO_ANSWER = frozenset({"", "proof", "notfound"})


def _check_fields(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("problem", "answer", "correctness_math_verify") if k not in record]
    if missing:
        raise ValueError(
            f"{where}: {OPENR1_MATH} rows need problem, answer and correctness_math_verify (OpenR1-Math-220k's "
            f"fields); missing {missing}, present {sorted(record)}. A set without verification fields loads as a "
            "generic source: data.path=FILE with another data.source name"
        )
    for key in ("correctness_math_verify", "correctness_llama"):
        value = record.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, bool) for v in value)):
            raise ValueError(f"{where}: {key} must be a list of booleans or null, got {value!r}")


def _parses(answer: str) -> bool:
    """Whether math-verify reads an answer from ``answer`` within :data:`PARSE_TIMEOUT_S`."""
    from gtpo_megatron.rewards.deadline import GradingTimeout, grading_deadline
    from gtpo_megatron.rewards.equivalence import parse_span

    try:
        with grading_deadline(PARSE_TIMEOUT_S):
            return bool(parse_span(answer))
    except (GradingTimeout, Exception):  # noqa: BLE001 - a reference math-verify fails on is unusable
        return False


def openr1_problem(record: Any, *, default_id: str, where: str) -> Problem | str:
    """One row as a :class:`Problem`, or the name of the reason it is dropped (module docstring).

    Raises:
        ValueError: a row that is not an OpenR1-Math row (missing or ill-typed fields; names ``where``).
    """
    _check_fields(record, where)
    question, answer = str(record["problem"]).strip(), str(record["answer"]).strip()
    if not question:
        raise ValueError(f"{where}: field 'problem' is empty")
    if record.get("question_type") == "proof" or answer.lower() in _NO_ANSWER:
        return "no_final_answer"
    if not any(record["correctness_math_verify"]) and not any(record.get("correctness_llama") or ()):
        return "unverified"
    if not _parses(answer):
        return "unparseable_answer"
    return Problem(id=str(record.get("uuid", default_id)), question=question, answer=answer, source=OPENR1_MATH)
