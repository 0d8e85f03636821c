"""What a reader of the README and docs/ follows leads somewhere: no path outside the repository (a clone has no
`../shared`) and no tracker issue number (the reader has no tracker to look it up in)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
OUTSIDE = re.compile(r"\.\./shared|\.\./\.\./")
ISSUE = re.compile(r"\bissues? #?\d+|\(#\d+\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_cites_nothing_a_clone_lacks(doc: Path) -> None:
    lines = doc.read_text().splitlines()
    found = [f"{doc.name}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
             if OUTSIDE.search(line) or ISSUE.search(line)]
    assert found == []
