"""The GraphQL documents the SDK sends, read from graphql/operations/ (one file per operation)."""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent / "graphql" / "operations"
_INSTALLED = Path(sys.prefix) / "share" / "rewardsignal" / "operations"  # pyproject's data-files
OPERATIONS_DIR = _CHECKOUT if _CHECKOUT.is_dir() else _INSTALLED


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
