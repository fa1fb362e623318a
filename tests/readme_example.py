"""The README's Python example, extracted from the README itself so that it cannot drift.

``python tests/readme_example.py README.md`` runs the example (the wheel smoke test does this in a
fresh virtual environment); ``tests/test_readme.py`` runs it in the test suite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: The example is the first ``python`` block after this heading line of the README.
ANCHOR = "Using it directly:"


def readme_example(readme: Path) -> str:
    """The source of the README's first Python example after :data:`ANCHOR`.

    Args:
        readme: Path of the README.

    Returns:
        The code between the fences.

    Raises:
        LookupError: The README has no such block.
    """
    text = readme.read_text(encoding="utf-8")
    start = text.find(ANCHOR)
    if start < 0:
        raise LookupError(f"{readme}: no line {ANCHOR!r}")
    match = re.search(r"^```python\n(.*?)^```$", text[start:], re.DOTALL | re.MULTILINE)
    if match is None:
        raise LookupError(f"{readme}: no ```python block after {ANCHOR!r}")
    return match.group(1)


def run_example(readme: Path) -> dict[str, object]:
    """Runs the example in a fresh namespace and returns that namespace."""
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(readme_example(readme), f"{readme}:example", "exec"), namespace)
    return namespace


if __name__ == "__main__":
    run_example(Path(sys.argv[1]))
    print("README example ran")
