"""GraphQL's sample(checkpoint:) and forward(checkpoint:) take the `signal://<run>/<kind>/<name>` path that
docs/CHECKPOINTS.md gives (and loadState takes) as well as a bare name, and the SDL says so (issue 34, #16)."""

from __future__ import annotations

from typing import Any

from app.schema import schema
from tests.helpers.live_server import LiveServer

SAMPLE = """mutation($r: ID, $c: String) { sample(runId: $r, prompts: ["Hi"], maxTokens: 2, seed: 1, checkpoint: $c)
  { sequences { tokens } } }"""
FORWARD = """mutation($r: ID, $c: String) { forward(runId: $r, checkpoint: $c,
  batch: [{modelInput: [1, 2, 3], lossFnInputs: {targetTokens: [2, 3, 4]}}]) { loss } }"""


def tokens(body: dict[str, Any]) -> list[int]:
    assert "errors" not in body, body
    return list(body["data"]["sample"]["sequences"][0][0]["tokens"])


def test_a_signal_path_names_the_same_weights_as_the_bare_name(live_server: LiveServer, key: str) -> None:
    run = live_server.graphql("mutation { createRun(input: {loraR: 4}) { id } }", key=key)["data"]["createRun"]["id"]
    saved = live_server.graphql('mutation($r: ID!) { saveState(runId: $r, mode: STATE, name: "c1") { name } }',
                                {"r": run}, key=key)
    assert "errors" not in saved, saved
    path = f"signal://{run}/state/c1"
    by_name = tokens(live_server.graphql(SAMPLE, {"r": run, "c": "c1"}, key=key))
    assert tokens(live_server.graphql(SAMPLE, {"r": run, "c": path}, key=key)) == by_name
    assert tokens(live_server.graphql(SAMPLE, {"c": path}, key=key)) == by_name  # the path names the run
    forward = [live_server.graphql(FORWARD, {"r": run, "c": c}, key=key) for c in ("c1", path)]
    assert forward[0]["data"]["forward"]["loss"] == forward[1]["data"]["forward"]["loss"]
    other = live_server.graphql(SAMPLE, {"r": "someotherrun", "c": path}, key=key)
    assert other["errors"][0]["extensions"]["code"] == "BAD_INPUT"
    assert other["errors"][0]["extensions"]["field"] == "checkpoint"


def test_the_sdl_says_checkpoint_takes_a_path() -> None:
    mutation = schema._schema.mutation_type
    assert mutation is not None
    for field in ("sample", "forward"):
        assert "signal://<run_id>/<kind>/<name>" in (mutation.fields[field].args["checkpoint"].description or "")
