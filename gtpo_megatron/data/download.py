"""``gtpo-data``: download the benchmarks once and write the jsonl layout that ``load_problems`` reads.

    gtpo-data --out DIR gsm8k math500 aime24 aime25 amc23 mmlu    # then: export GTPO_DATA_DIR=DIR
    gtpo-data --out DIR openr1-math                                # the R1-style training set (not by default)

Each source of :data:`~gtpo_megatron.data.benchmarks.BENCHMARKS` is loaded split by split from its Hugging Face
dataset with ``datasets`` (``pip install datasets``; needs network access) and written to
``DIR/<folder>/<split>.jsonl`` (``gsm8k/train.jsonl``, ``amc2023/test.jsonl``, ...), one JSON object per line with
the id of the source row and its question and answer fields (a benchmark's ``fields`` where it names them: MMLU's
choices and subject, OpenR1-Math's verification fields); the written file is read back with
``read_jsonl`` so that a file that would not load is never left behind. Existing files are kept unless ``--force``.
Without ``datasets`` or offline it exits with status 2 and a message saying what to do instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gtpo_megatron.data.benchmarks import ANSWER_KEYS, BENCHMARKS, OPENR1_MATH, QUESTION_KEYS, load_hub_rows
from gtpo_megatron.data.datasets import default_data_dir, default_download_dir, read_jsonl

DEFAULT_SOURCES = [name for name in BENCHMARKS if name != OPENR1_MATH]


def download_benchmark(source: str, out_dir: str | Path, *, force: bool = False) -> list[tuple[Path, int]]:
    """Write every split of the benchmark ``source`` under ``out_dir``; returns ``(file, problems)`` per split.

    Raises:
        ValueError: ``source`` is not a key of ``BENCHMARKS``.
        RuntimeError: ``datasets`` is missing or the download failed (see ``benchmarks.load_hub_rows``).
    """
    if source not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {source!r}; choose from {sorted(BENCHMARKS)}")
    written = []
    for split in BENCHMARKS[source].splits:
        path = Path(out_dir) / BENCHMARKS[source].folder / f"{split}.jsonl"
        if path.is_file() and not force:
            written.append((path, len(read_jsonl(path, source=source))))
            continue
        rows = load_hub_rows(source, split=split)
        records = [_record(row, source, split, i) for i, row in enumerate(rows)]
        written.append((path, _write_jsonl(path, records, source)))
    return written


def _record(row: dict, source: str, split: str, index: int) -> dict:
    """The jsonl object of one hub row: an id, then its benchmark's ``fields`` or the question/answer fields."""
    record = {"id": str(row.get("id", row.get("unique_id", f"{source}-{split}-{index}")))}
    fields = BENCHMARKS[source].fields
    if fields is not None:
        return record | {key: row[key] for key in fields if key in row}
    for keys in (QUESTION_KEYS, ANSWER_KEYS):
        key = next((k for k in keys if row.get(k) is not None), None)
        if key is not None:
            value = row[key]  # AMC 2023's hub answers are floats: 27.0 is written "27"
            record[key] = str(int(value)) if isinstance(value, float) and value.is_integer() else value
    return record


def _write_jsonl(path: Path, records: list[dict], source: str) -> int:
    """Write ``records`` to ``path`` through a temporary file, check it loads, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    try:
        count = len(read_jsonl(tmp, source=source))
    except ValueError:
        tmp.unlink()
        raise
    os.replace(tmp, path)
    return count


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns 0, or 2 with a message on stderr."""
    parser = argparse.ArgumentParser(prog="gtpo-data", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sources", nargs="*", default=DEFAULT_SOURCES, help=f"any of {list(BENCHMARKS)} [{' '.join(DEFAULT_SOURCES)}]"
    )
    parser.add_argument("--out", default=None, help=f"data folder [{default_download_dir()}]")
    parser.add_argument("--force", action="store_true", help="download again over existing files")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_download_dir()
    try:
        for source in args.sources:
            for path, count in download_benchmark(source, out, force=args.force):
                print(f"{path}: {count} problems")
    except (ValueError, RuntimeError) as err:
        print(f"gtpo-data: {err}", file=sys.stderr)
        return 2
    if out.resolve() == default_data_dir().resolve():
        print(f"done: {out} is the default data folder of gtpo-train and gtpo-eval")
    else:
        print(f"done: export GTPO_DATA_DIR={out} so that gtpo-train and gtpo-eval read it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
