"""Prose and layout statistics of the package: docstring share and docstrings longer than their body.

Usage: python scripts/code_stats.py [--list] [PATH ...]   (default: gtpo_megatron)

Prints the package's line count, the share of lines inside docstrings (module, class and function), and the
functions whose docstring is 10 or more lines longer than their body (``--list`` names them).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _docstring_span(node: ast.AST) -> int:
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr):
        return 0
    value = body[0].value
    if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
        return 0
    return body[0].end_lineno - body[0].lineno + 1


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, doc_lines: int) -> int:
    return node.end_lineno - node.body[0].lineno + 1 - doc_lines


def file_stats(path: Path) -> tuple[int, int, list[str]]:
    """Returns (lines, docstring lines, ``file:line name doc/body`` of long-docstring functions)."""
    text = path.read_text()
    tree = ast.parse(text)
    doc_total = _docstring_span(tree)
    long_docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            doc_total += _docstring_span(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = _docstring_span(node)
            doc_total += doc
            body = _body_lines(node, doc)
            if doc >= body + 10:
                long_docs.append(f"{path}:{node.lineno} {node.name} {doc}/{body}")
    return len(text.splitlines()), doc_total, long_docs


def main(argv: list[str] | None = None) -> int:
    """Print the statistics of ``paths``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["gtpo_megatron"])
    parser.add_argument("--list", action="store_true", help="name the functions with long docstrings")
    args = parser.parse_args(argv)
    files = sorted(f for p in args.paths for f in (Path(p).rglob("*.py") if Path(p).is_dir() else [Path(p)]))
    lines = docs = 0
    long_docs: list[str] = []
    for f in files:
        n, d, longs = file_stats(f)
        lines, docs = lines + n, docs + d
        long_docs += longs
    print(f"files {len(files)}  lines {lines}  docstring lines {docs} ({100 * docs / max(lines, 1):.1f}%)")
    print(f"functions with a docstring 10+ lines longer than the body: {len(long_docs)}")
    if args.list:
        print("\n".join(long_docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
