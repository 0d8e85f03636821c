"""The runtime's state is an admin-only GraphQL field; anyone else gets FORBIDDEN."""

from __future__ import annotations

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, error_code

RUNTIME = "{ runtime }"


def test_admins_read_the_runtime_state(live_server: LiveServer, key: str) -> None:
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4)
    run.forward_backward(batch=[{"text": "one example"}])
    body = live_server.graphql(RUNTIME, key=live_server.new_user(is_admin=True))
    assert "errors" not in body
    state = body["data"]["runtime"]
    resident = {r["run_id"]: r for r in state["resident_runs"]}
    assert [base["name"] for base in state["bases"]] == [resident[run.id]["base_model"]]
    assert resident[run.id]["step"] == 0 and resident[run.id]["bytes"] > 0
    assert isinstance(state["evicted_runs"], list) and state["queue_depth"] == {}
    assert state["ticks"]["base_passes"] >= 1 and state["ticks"]["fb_rows"] >= 1


def test_other_users_are_forbidden(live_server: LiveServer, key: str) -> None:
    body = live_server.graphql(RUNTIME, key=key)
    assert error_code(body) == "FORBIDDEN" and body["data"] is None
    assert "admin" in body["errors"][0]["message"]
