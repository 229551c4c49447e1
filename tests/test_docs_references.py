"""What the tracked files cite must exist in a clone of the repository.

- every "docs/algorithm.md section N" (also "sections N-M", "sections N and M", "§N") names a ``## N. Title``
  heading of ``docs/algorithm.md``, and nothing cites the algorithm under another name (``docs/algorithm.md``);
- every backquoted ``path.py:Name`` or ``path.py:Class.method`` in ``docs/*.md`` and ``README.md`` names a file of
  the repository (or of the package) that defines it (read with ``ast``);
- no file outside ``tests/`` names the development machine's ``../shared`` folder (tests may read data there);
- no tracked file speaks of the project's issue tracker by number: the product speaks of itself only.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALGORITHM_DOC = "docs/algorithm.md"
_SECTIONS = r"(?P<numbers>\d+(?:[\s#]*(?:-|–|,|and|or|&)[\s#]*\d+)*)"
CITATION = re.compile(r"docs/algorithm\.md`*[\s#*\"',]*(?:sections?\s*|§\s*)" + _SECTIONS, re.IGNORECASE)
OLD_NAME = re.compile("GTPO" + "_SPEC")
SHARED = re.compile(r"\.\./shared|/work/shared")
ISSUE = re.compile(r"\bissues?[\s#_-]*\d+", re.IGNORECASE)
CODE_REFERENCE = re.compile(r"`(?P<path>[\w./-]+\.py):(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def tracked_texts() -> dict[str, str]:
    """``{path: text}`` of every tracked text file (binary files are skipped)."""
    paths = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    texts = {}
    for name in paths.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def section_numbers(markdown: str) -> set[int]:
    """Numbers of the ``## N. Title`` headings."""
    return {int(number) for number in re.findall(r"^## (\d+)\. \S", markdown, re.MULTILINE)}


def cited_sections(text: str) -> list[int]:
    """Section numbers cited as docs/algorithm.md sections; ``N-M`` ranges are expanded."""
    cited = []
    for match in CITATION.finditer(text):
        numbers = match.group("numbers")
        for start, end in re.findall(r"(\d+)\s*[-–]\s*(\d+)", numbers):
            cited.extend(range(int(start), int(end) + 1))
        cited.extend(int(n) for n in re.findall(r"\d+", re.sub(r"\d+\s*[-–]\s*\d+", "", numbers)))
    return cited


def test_citation_parser_on_hand_written_text():
    text = (
        "(docs/algorithm.md section 4; see ``docs/algorithm.md`` sections 1-3 and docs/algorithm.md sections 5 and\n"
        "    # 9, docs/algorithm.md §8)"
    )
    assert sorted(cited_sections(text)) == [1, 2, 3, 4, 5, 8, 9]
    assert section_numbers("# t\n## 1. Objective\n### 1.1 no\n## 12. Later\n") == {1, 12}
    word = "issue"  # spelled apart so that this file passes its own check
    assert ISSUE.search(f"fixed in {word.title()} 12 item 3") and ISSUE.search(f"the {word}-13 example")
    assert not ISSUE.search("a known issue of vLLM (vllm-project/vllm#42821)")


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return tracked_texts()


def test_every_citation_names_an_existing_section(texts):
    sections = section_numbers((ROOT / ALGORITHM_DOC).read_text())
    assert set(range(1, 9)) <= sections, f"{ALGORITHM_DOC} must keep sections 1-8; it has {sorted(sections)}"
    missing = [
        f"{name}: section {number}"
        for name, text in texts.items()
        for number in cited_sections(text)
        if number not in sections
    ]
    assert not missing, f"citations of sections {ALGORITHM_DOC} lacks (it has {sorted(sections)}): {missing}"
    old = [name for name, text in texts.items() if OLD_NAME.search(text) and name != "tests/test_docs_references.py"]
    assert not old, f"cite {ALGORITHM_DOC} section N, not the spec's old name, in {old}"


def test_nothing_outside_tests_names_the_shared_folder(texts):
    found = [name for name, text in texts.items() if not name.startswith("tests/") and SHARED.search(text)]
    assert not found, f"a clone has no ../shared folder; these files name it: {found}"


def test_no_tracked_file_cites_an_issue_number(texts):
    found = [
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}"
        for name, text in texts.items()
        for match in ISSUE.finditer(text)
    ]
    assert not found, f"say what the change means instead of citing an issue number: {found}"


def test_relative_links_of_the_documentation_resolve(texts):
    broken = []
    for name, text in texts.items():
        if not name.endswith(".md"):
            continue
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (ROOT / name).parent.joinpath(target).exists():
                broken.append(f"{name}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def _names(node: ast.stmt) -> set[str]:
    """The names one statement of a module or class body binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {target.id for target in targets if isinstance(target, ast.Name)}


def unresolved(path: str, name: str) -> str | None:
    """Why ``path.py:name`` (``Name`` or ``Class.member``) names nothing, or None when it resolves."""
    files = [file for file in (ROOT / path, ROOT / "gtpo_megatron" / path) if file.is_file()]
    if not files:
        return "no such file"
    body = ast.parse(files[0].read_text()).body
    for part in name.split("."):
        node = next((node for node in body if part in _names(node)), None)
        if node is None:
            return f"{part!r} is not defined there"
        body = node.body if isinstance(node, ast.ClassDef) else []
    return None


def test_reference_resolver_on_hand_written_names():
    assert unresolved("rollout/pipeline.py", "AsyncRollouts.take") is None
    assert unresolved("gtpo_megatron/ops/losses.py", "LossSpec.off_policy_cap") is None
    assert unresolved("ops/losses.py", "LossSpec.nothing") == "'nothing' is not defined there"
    assert unresolved("ops/nothing.py", "LossSpec") == "no such file"
    text = "see `trainer.py:Trainer._train` and ``plan/layout.py:row_shard``, not `a.py` or `b.py:3`"
    assert [m.group("path", "name") for m in CODE_REFERENCE.finditer(text)] == [
        ("trainer.py", "Trainer._train"),
        ("plan/layout.py", "row_shard"),
    ]


def test_every_code_reference_of_the_documentation_resolves(texts):
    docs = {name: text for name, text in texts.items() if name == "README.md" or re.fullmatch(r"docs/[^/]+\.md", name)}
    found = [
        (name, m.group("path"), m.group("name")) for name, text in docs.items() for m in CODE_REFERENCE.finditer(text)
    ]
    assert len(found) >= 50, f"the documentation's code references were not found: {found}"
    broken = [f"{doc}: {path}:{name} ({why})" for doc, path, name in found if (why := unresolved(path, name))]
    assert not broken, f"references to code that does not exist: {broken}"
