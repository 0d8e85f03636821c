"""Bodies that are not a GraphQL request object get 400 in GraphQL's error shape, before authentication (no key is
sent): never a 500, never strawberry's plain text."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.live_server import LiveServer

JSON = {"Content-Type": "application/json"}
NESTED = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize(("body", "headers", "says"), [
    (b"42", JSON, "JSON object"),
    (b'"x"', JSON, "JSON object"),
    (b"null", JSON, "JSON object"),
    (b"\xff\xfe{", JSON, "UTF-8"),
    (NESTED, JSON, "nested too deeply"),
    (b"{not json", JSON, "parse"),
    (b'{"query": 5}', JSON, "`query` must be a string"),
    (b'{"query": "{ me { id } }", "variables": [1]}', JSON, "`variables` must be an object"),
    (b"[]", JSON, "JSON object"),
    (b"query { me { id } }", {"Content-Type": "text/plain"}, "Unsupported content type"),
], ids=["number", "string", "null", "invalid-utf8", "nested-5000", "not-json", "query-not-string",
        "variables-not-object", "batch", "text-plain"])
def test_malformed_body_is_a_graphql_shaped_400(live_server: LiveServer, body: bytes, headers: dict[str, str],
                                                 says: str) -> None:
    response = httpx.post(f"{live_server.url}/graphql", content=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    (error,) = response.json()["errors"]
    assert error["extensions"]["code"] == "BAD_INPUT"
    assert says in error["message"]


def test_lone_surrogate_in_variables_is_refused_naming_the_variable(live_server: LiveServer) -> None:
    body = (b'{"query": "mutation($r: ID!, $p: [String!]!) { sample(runId: $r, prompts: $p) { outputs } }", '
            b'"variables": {"r": "x", "p": ["fine", "a\\ud800"]}}')
    response = httpx.post(f"{live_server.url}/graphql", content=body, headers=JSON, timeout=30)
    assert response.status_code == 400
    (error,) = response.json()["errors"]
    assert error["extensions"]["code"] == "BAD_INPUT"
    assert "variables.p[1]" in error["message"] and "surrogate" in error["message"]


def test_a_paired_surrogate_escape_is_text(live_server: LiveServer) -> None:
    """An emoji escaped as a UTF-16 pair is valid text: it reaches GraphQL (and here, authentication)."""
    body = b'{"query": "{ me { email } }", "variables": {"x": "\\ud83d\\ude00"}}'
    response = httpx.post(f"{live_server.url}/graphql", content=body, headers=JSON, timeout=30)
    (error,) = response.json()["errors"]
    assert error["extensions"]["code"] == "UNAUTHENTICATED"

