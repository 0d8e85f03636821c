"""The runtime's state is an admin-only GraphQL field; anyone else gets FORBIDDEN."""

from __future__ import annotations

from tests.helpers.live_server import LiveServer, error_code

RUNTIME = "{ runtime }"


def test_admins_read_the_runtime_state(live_server: LiveServer) -> None:
    body = live_server.graphql(RUNTIME, key=live_server.new_user(is_admin=True))
    assert "errors" not in body
    assert isinstance(body["data"]["runtime"], dict)  # its content is the runtime's to define


def test_other_users_are_forbidden(live_server: LiveServer, key: str) -> None:
    body = live_server.graphql(RUNTIME, key=key)
    assert error_code(body) == "FORBIDDEN" and body["data"] is None
    assert "admin" in body["errors"][0]["message"]
