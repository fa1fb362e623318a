"""Checks that the repository stands on its own.

Comments, docstrings and tests cite the behaviour specification, ``docs/behaviour.md``, as
"SPEC": sections by number (``SPEC §5.1``) and rules by id (``POOL-5``, ``STM-1..12``,
``HASH-2/3``). These tests check that every such citation in a tracked file resolves in that
document, and that no tracked file points at files outside the repository.

They read files only (no ``kvcore`` import), so they run before the package is built.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
"""The repository root (this file is ``tests/test_docs.py``)."""

BEHAVIOUR_DOC = "docs/behaviour.md"
"""The behaviour specification, relative to the repository root."""

RULE_CITATION = re.compile(
    r"\b(?P<prefix>[A-Z]{2,6})-(?P<first>[0-9]+)(?:\.\.(?P<last>[0-9]+)|(?P<more>(?:/[0-9]+)+))?\b"
)
"""A rule id, a range of ids (``STM-1..12``) or a list of ids (``MGR-6/7``)."""

NOT_RULE_IDS = frozenset({"SHA-256", "UTF-8", "UTF-16", "XXH-3", "XXH-128"})
"""Tokens that look like rule ids but name something else."""

SECTION_CITATION = re.compile(r"§ ?(?P<section>[0-9]+(?:\.[0-9]+)*)")
"""A section citation, ``SPEC §5.1`` or a bare ``§5.1``."""

FOREIGN_SECTION = re.compile(r"\bRFC ?[0-9]+ ?$")
"""Text just before a ``§`` that makes it a section of another document (``RFC 8949 §4.2``)."""

TEST_VECTOR_CITATION = re.compile(r"\bTV-[A-Z][A-Z0-9]*\b")
"""A test-vector set or scenario of SPEC §19 (``TV-H``, ``TV-S3``)."""

RULE_LABEL = re.compile(r"^- (?P<rule>[A-Z]{2,6}-[0-9]+)\b", re.MULTILINE)
"""A rule definition: a top-level list item that starts with the rule id."""

SECTION_HEADING = re.compile(r"^#{2,3} (?P<section>[0-9]+(?:\.[0-9]+)*)\.? ", re.MULTILINE)
"""A numbered section heading (``## 4. BlockPool``, ``### 4.1 Construction``)."""

TEST_VECTOR_LABEL = re.compile(r"^(?:#{2,4} |\*\*).*", re.MULTILINE)
"""A heading or bold label line, where test-vector names are defined."""

# Built by concatenation so that this file does not contain them itself.
FOREIGN_PATHS = (".." + "/shared", "/work" + "/shared")
"""Paths outside the repository that no tracked file may mention."""


def tracked_files() -> list[Path]:
    """Lists the tracked files that exist in the working tree.

    Returns:
        Paths relative to the repository root, as ``git ls-files`` orders them.
    """
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        [git, "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    return [Path(p) for p in out.split("\0") if p and (REPO / p).is_file()]


def text_files() -> Iterator[tuple[Path, str]]:
    """Yields every tracked text file with its contents; binary files are left out.

    Yields:
        The path relative to the repository root and the file's text.
    """
    for path in tracked_files():
        data = (REPO / path).read_bytes()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def line_of(text: str, offset: int) -> int:
    """The 1-based line number of a character offset."""
    return text.count("\n", 0, offset) + 1


class Definitions:
    """The rule ids, sections and test-vector names that the behaviour document defines.

    Attributes:
        rules: Rule ids, each defined by a list item starting with it.
        sections: Section numbers of the numbered headings (``"5"``, ``"5.1"``).
        test_vectors: Test-vector names used in headings and scenario labels.
        duplicate_rules: Rule ids defined more than once.
    """

    def __init__(self, text: str) -> None:
        """Reads the definitions from the document.

        Args:
            text: The behaviour document.
        """
        labels = [m["rule"] for m in RULE_LABEL.finditer(text)]
        self.rules = frozenset(labels)
        self.duplicate_rules = sorted({r for r in labels if labels.count(r) > 1})
        self.sections = frozenset(m["section"] for m in SECTION_HEADING.finditer(text))
        self.test_vectors = frozenset(
            tv
            for line in TEST_VECTOR_LABEL.findall(text)
            for tv in TEST_VECTOR_CITATION.findall(line)
        )


def definitions() -> Definitions:
    """The definitions of the behaviour document.

    Returns:
        What ``docs/behaviour.md`` defines.
    """
    return Definitions((REPO / BEHAVIOUR_DOC).read_text(encoding="utf-8"))


def unresolved_citations(text: str, defs: Definitions) -> Iterator[tuple[int, str]]:
    """Finds the citations in one file's text that the behaviour document does not define.

    Args:
        text: The file's contents.
        defs: The document's definitions.

    Yields:
        The line number and a description of each unresolved citation.
    """
    for m in RULE_CITATION.finditer(text):
        prefix, first = m["prefix"], int(m["first"])
        if f"{prefix}-{first}" in NOT_RULE_IDS or m[0] in NOT_RULE_IDS:
            continue
        numbers = [first]
        if m["last"] is not None:
            numbers.append(int(m["last"]))
            if numbers[1] <= first:
                yield line_of(text, m.start()), f"{m[0]} (empty range)"
        if m["more"] is not None:
            numbers += [int(n) for n in m["more"].split("/")[1:]]
        missing = [f"{prefix}-{n}" for n in numbers if f"{prefix}-{n}" not in defs.rules]
        if missing:
            yield line_of(text, m.start()), f"{m[0]} (no rule {', '.join(missing)})"
    for m in SECTION_CITATION.finditer(text):
        if FOREIGN_SECTION.search(text, 0, m.start()):
            continue
        if m["section"] not in defs.sections:
            yield line_of(text, m.start()), f"§{m['section']} (no such section)"
    for m in TEST_VECTOR_CITATION.finditer(text):
        if m[0] not in defs.test_vectors:
            yield line_of(text, m.start()), f"{m[0]} (no such test vector)"


def test_behaviour_document_defines_each_rule_once() -> None:
    """Rule ids, section numbers and the labels the other test relies on are well formed."""
    defs = definitions()
    assert not defs.duplicate_rules, f"rules defined more than once: {defs.duplicate_rules}"
    for must in ("POOL-5", "ALLOC-7", "KVB-4", "STM-12"):
        assert must in defs.rules
    for section in ("1", "5.1", "8.1", "17", "20"):
        assert section in defs.sections
    assert {"TV-H", "TV-R", "TV-B", "TV-S", "TV-S1", "TV-S4"} <= defs.test_vectors


def test_every_citation_resolves_in_the_behaviour_document() -> None:
    """Every rule id, ``§`` section and test vector cited in a tracked file is defined."""
    defs = definitions()
    problems = [
        f"{path}:{line}: {what}"
        for path, text in text_files()
        for line, what in unresolved_citations(text, defs)
    ]
    assert not problems, (
        f"{len(problems)} citation(s) do not resolve in {BEHAVIOUR_DOC}:\n" + "\n".join(problems)
    )


def sample(text: str) -> str:
    """Expands the placeholders of a checker sample.

    The samples are written with ``<p>`` for a rule prefix, ``<s>`` for the section sign and
    ``<tv>`` for the test-vector prefix, so that this file's own citations stay real.

    Args:
        text: The sample with placeholders.

    Returns:
        The sample as a cited file or the behaviour document would spell it.
    """
    return text.replace("<p>", "QZX").replace("<s>", "§").replace("<tv>", "TV")


def test_citation_checker_reports_what_it_should() -> None:
    """The checker flags unknown ids, ranges and sections and ignores look-alikes."""
    defs = Definitions(
        sample(
            "## 5. Hashing\n### 5.1 Functions\n### <tv>-H: hashes\n**S1 (<tv>-S1) reuse**\n"
            "- <p>-1 One.\n- <p>-2 Two.\n- <p>-5 Five.\n  - <p>-6 is not a label.\n"
        )
    )
    assert defs.rules == {sample("<p>-1"), sample("<p>-2"), sample("<p>-5")}
    text = sample(
        "<p>-1 <p>-1..5 <p>-2/5 SPEC <s>5.1 <s>5. <tv>-H <tv>-S1 SHA-256 UTF-8 RFC 8949 <s>4.2\n"
        "<p>-3 <p>-1..7 <p>-2/4 SPEC <s>5.2 (<s>6) <tv>-S2 <p>-5..2 <p>-6.\n"
    )
    found = list(unresolved_citations(text, defs))
    assert found == [
        (2, sample(what))
        for what in (
            "<p>-3 (no rule <p>-3)",
            "<p>-1..7 (no rule <p>-7)",
            "<p>-2/4 (no rule <p>-4)",
            "<p>-5..2 (empty range)",
            "<p>-6 (no rule <p>-6)",
            "<s>5.2 (no such section)",
            "<s>6 (no such section)",
            "<tv>-S2 (no such test vector)",
        )
    ]


def test_no_tracked_file_points_outside_the_repository() -> None:
    """No tracked text file mentions the directory beside the checkout."""
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path, text in text_files()
        for n, line in enumerate(text.splitlines(), 1)
        if any(p in line for p in FOREIGN_PATHS)
    ]
    assert not hits, "tracked files mention paths outside the repository:\n" + "\n".join(hits)
