"""A checkpoint name shaped like a default name never reaches another checkpoint's files (issue 34, finding 3):
"step-00" and "step-0" both mapped to checkpoints/state_step_0, so saving them after a step overwrote the step-0
state, and deleting one took the other's files. Now only the canonical step-N of a save without a name lives there,
an explicit name that exists is refused, and every listed checkpoint keeps its own step and loads."""

from __future__ import annotations

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, error_code

BATCH = [{"text": "Machine learning is transforming technology."}]
SAVE = """mutation($id: ID!, $name: String) { saveState(runId: $id, mode: STATE, name: $name) { id name step path } }"""
LOAD = """mutation($id: ID!, $checkpoint: String!) {
    loadState(runId: $id, checkpoint: $checkpoint, withOptimizer: true) { step } }"""
DELETE = "mutation($id: ID!, $cid: ID!) { deleteCheckpoint(runId: $id, checkpointId: $cid) }"
LIST = "query($id: ID!) { run(id: $id) { checkpoints { id name step } } }"


def test_step_shaped_names_never_share_a_checkpoints_files(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    first = live_server.graphql(SAVE, {"id": run.id, "name": None}, key=key)["data"]["saveState"]
    assert (first["name"], first["step"]) == ("step-0", 0)
    run.forward_backward(BATCH)
    run.optim_step(learning_rate=1e-2)

    padded = live_server.graphql(SAVE, {"id": run.id, "name": "step-00"}, key=key)
    assert "errors" not in padded, padded
    assert (padded["data"]["saveState"]["name"], padded["data"]["saveState"]["step"]) == ("step-00", 1)
    again = live_server.graphql(SAVE, {"id": run.id, "name": "step-0"}, key=key)
    assert error_code(again) == "FAILED_PRECONDITION" and again["errors"][0]["extensions"]["field"] == "name"

    listed = {c["name"]: c for c in live_server.graphql(LIST, {"id": run.id}, key=key)["data"]["run"]["checkpoints"]}
    assert {name: c["step"] for name, c in listed.items()} == {"step-0": 0, "step-00": 1}
    deleted = live_server.graphql(DELETE, {"id": run.id, "cid": listed["step-00"]["id"]}, key=key)
    assert deleted["data"]["deleteCheckpoint"] is True
    # step-0 kept its own files: it loads, and brings the run back to step 0.
    loaded = live_server.graphql(LOAD, {"id": run.id, "checkpoint": "step-0"}, key=key)
    assert "errors" not in loaded, loaded
    assert loaded["data"]["loadState"]["step"] == 0


def test_a_save_without_a_name_at_a_later_step_never_replaces_an_explicit_step_name(live_server: LiveServer,
                                                                                    key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    early = live_server.graphql(SAVE, {"id": run.id, "name": "step-1"}, key=key)  # at step 0, named for step 1
    assert early["data"]["saveState"]["step"] == 0
    run.forward_backward(BATCH)
    run.optim_step(learning_rate=1e-2)
    later = live_server.graphql(SAVE, {"id": run.id, "name": None}, key=key)  # its default name is step-1 too
    assert error_code(later) == "FAILED_PRECONDITION", later
    listed = live_server.graphql(LIST, {"id": run.id}, key=key)["data"]["run"]["checkpoints"]
    assert [(c["name"], c["step"]) for c in listed] == [("step-1", 0)]
