"""The exported SDL matches the live schema, and every SDK operation document is valid against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.schema import schema
from graphql import parse, validate
from rewardsignal.operations import document, names

REPO = Path(__file__).resolve().parents[2]


def test_exported_sdl_matches_the_live_schema() -> None:
    exported = (REPO / "graphql" / "schema.graphql").read_text()
    assert exported == schema.as_str() + "\n", "run `make schema` to export the SDL again"


def test_graphql_dir_is_not_a_python_package() -> None:
    assert not (REPO / "graphql" / "__init__.py").exists()


@pytest.mark.parametrize("name", names())
def test_sdk_operation_is_valid(name: str) -> None:
    errors = validate(schema._schema, parse(document(name)))
    assert errors == []
