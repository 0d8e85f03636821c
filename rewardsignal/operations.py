"""The GraphQL documents the SDK sends: package data in rewardsignal/graphql/ (one file per operation).

The repository's graphql/operations is a symlink to that folder, so the checkout, an editable install and a
wheel all read the same files from beside this module.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

OPERATIONS_DIR = Path(__file__).resolve().parent / "graphql"


@cache
def _fragments() -> dict[str, str]:
    text = (OPERATIONS_DIR / "fragments.graphql").read_text()
    return {match.group(1): match.group(0) for match in re.finditer(r"fragment (\w+) on \w+ \{.*?\n\}", text, re.S)}


@cache
def document(name: str) -> str:
    """The operation `name` with the fragments it spreads appended."""
    text = (OPERATIONS_DIR / f"{name}.graphql").read_text()
    used = sorted(set(re.findall(r"\.\.\.(\w+)", text)))
    return "\n".join([text, *(_fragments()[fragment] for fragment in used)])


def names() -> list[str]:
    return sorted(path.stem for path in OPERATIONS_DIR.glob("*.graphql") if path.stem != "fragments")
