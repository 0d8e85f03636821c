"""Checkpoints over GraphQL and the SDK against a live server (docs/CHECKPOINTS.md): named saves, loadState,
createRun(fromCheckpoint), listing, download and deleteCheckpoint; another user's checkpoint is NOT_FOUND."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rewardsignal import SignalClient
from rewardsignal.errors import SignalAPIError
from tests.helpers.live_server import LiveServer, error_code
from tests.helpers.modal_server import LOCAL_WARNING, live_server_on_both_backends  # noqa: F401 - the fixture: every test on both backends

pytestmark = pytest.mark.filterwarnings(LOCAL_WARNING)


BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."},
         {"text": "Machine learning is transforming technology."}]
SAVE = """mutation($id: ID!, $name: String) { saveState(runId: $id, mode: STATE, name: $name) {
    id name mode step path checkpointPath downloadUrl } }"""
LOAD = """mutation($id: ID!, $checkpoint: String!, $opt: Boolean!) {
    loadState(runId: $id, checkpoint: $checkpoint, withOptimizer: $opt) { checkpoint step withOptimizer pendingDropped } }"""
CREATE = """mutation($input: CreateRunInput) { createRun(input: $input) { id step seed loraR loraAlpha loraDropout } }"""
DELETE = "mutation($id: ID!, $cid: ID!) { deleteCheckpoint(runId: $id, checkpointId: $cid) }"
LIST = "query($id: ID!) { run(id: $id) { step checkpoints { id name mode step path } } }"


def train(client: SignalClient, run_id: str, steps: int) -> None:
    run = client.get_run(run_id)
    for _ in range(steps):
        run.forward_backward(BATCH)
        run.optim_step(learning_rate=1e-2)


def test_save_load_and_create_from_a_checkpoint_over_graphql(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    source = client.create_run(lora_r=4, lora_dropout=0.1, seed=5)
    train(client, source.id, 2)
    saved = live_server.graphql(SAVE, {"id": source.id, "name": "two"}, key=key)
    assert "errors" not in saved, saved
    checkpoint = saved["data"]["saveState"]
    assert (checkpoint["name"], checkpoint["mode"], checkpoint["step"]) == ("two", "state", 2)
    assert checkpoint["path"] == f"signal://{source.id}/state/two"

    twice = live_server.graphql(SAVE, {"id": source.id, "name": "two"}, key=key)
    assert error_code(twice) == "FAILED_PRECONDITION" and twice["errors"][0]["extensions"]["field"] == "name"

    conflict = live_server.graphql(CREATE, {"input": {"fromCheckpoint": checkpoint["path"], "loraR": 8}}, key=key)
    assert error_code(conflict) == "BAD_INPUT" and conflict["errors"][0]["extensions"]["field"] == "loraR"
    created = live_server.graphql(CREATE, {"input": {"fromCheckpoint": checkpoint["path"], "seed": 5}}, key=key)
    assert "errors" not in created, created
    run = created["data"]["createRun"]
    assert (run["step"], run["seed"], run["loraR"], run["loraDropout"]) == (2, 5, 4, 0.1)

    train(client, source.id, 1)
    loaded = live_server.graphql(LOAD, {"id": source.id, "checkpoint": "two", "opt": False}, key=key)
    assert "errors" not in loaded, loaded
    assert loaded["data"]["loadState"] == {"checkpoint": checkpoint["path"], "step": 2, "withOptimizer": False,
                                           "pendingDropped": 0}
    listed = live_server.graphql(LIST, {"id": source.id}, key=key)["data"]["run"]
    assert listed["step"] == 2 and [(c["name"], c["mode"]) for c in listed["checkpoints"]] == [("two", "state")]

    deleted = live_server.graphql(DELETE, {"id": source.id, "cid": checkpoint["id"]}, key=key)
    assert deleted["data"]["deleteCheckpoint"] is True
    assert not Path(checkpoint["checkpointPath"]).exists()
    assert live_server.graphql(LIST, {"id": source.id}, key=key)["data"]["run"]["checkpoints"] == []
    gone = live_server.graphql(LOAD, {"id": source.id, "checkpoint": "two", "opt": False}, key=key)
    assert error_code(gone) == "NOT_FOUND" and gone["errors"][0]["extensions"]["field"] == "checkpoint"
    train(client, run["id"], 1)  # the run made from it trains on without it
    assert client.get_run(run["id"]).step == 3


def test_another_users_checkpoint_is_not_found(live_server: LiveServer, key: str) -> None:
    owner = SignalClient(api_key=key, base_url=live_server.url)
    run = owner.create_run(lora_r=4)
    train(owner, run.id, 1)
    checkpoint = live_server.graphql(SAVE, {"id": run.id, "name": "mine"}, key=key)["data"]["saveState"]
    other = live_server.new_user()
    theirs = SignalClient(api_key=other, base_url=live_server.url).create_run(lora_r=4)

    load = live_server.graphql(LOAD, {"id": theirs.id, "checkpoint": checkpoint["path"], "opt": True}, key=other)
    assert error_code(load) == "NOT_FOUND" and load["errors"][0]["extensions"]["field"] == "checkpoint"
    create = live_server.graphql(CREATE, {"input": {"fromCheckpoint": checkpoint["path"]}}, key=other)
    assert error_code(create) == "NOT_FOUND" and create["errors"][0]["extensions"]["field"] == "fromCheckpoint"
    delete = live_server.graphql(DELETE, {"id": run.id, "cid": checkpoint["id"]}, key=other)
    assert error_code(delete) == "NOT_FOUND"
    download = httpx.get(checkpoint["downloadUrl"], headers={"Authorization": f"Bearer {other}"}, timeout=60)
    assert download.status_code == 404
    assert httpx.get(checkpoint["downloadUrl"], headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code == 200
    assert Path(checkpoint["checkpointPath"]).is_dir()  # nothing of it was touched


def test_the_sdk_saves_lists_downloads_loads_and_deletes(live_server: LiveServer, key: str, tmp_path: Path) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4, seed=2)
    train(client, run.id, 1)
    run.forward_backward(BATCH)  # pending at the save: a checkpoint leaves its gradients out, and says so
    final = run.save_state(mode="state", name="final")
    adapter = run.save_state(name="final")  # the same name, another kind
    assert (final.name, final.mode, adapter.name, adapter.mode) == ("final", "state", "final", "adapter")
    assert (final.with_optimizer, final.pending_excluded, adapter.with_optimizer) == (True, 1, False)
    assert sorted((c.mode, c.name, c.with_optimizer, c.pending_excluded) for c in run.checkpoints()) == [
        ("adapter", "final", False, 1), ("state", "final", True, 1)]
    files = final.download(tmp_path / "final")
    assert (Path(files) / "optimizer_state.pt").is_file() and (Path(files) / "checkpoint.json").is_file()

    resumed = client.create_run(from_checkpoint=final)
    assert resumed.step == 1
    train(client, run.id, 1)
    assert run.load_state(final)["step"] == 1
    run.delete_checkpoint(adapter)
    assert [(c.mode, c.name) for c in run.checkpoints()] == [("state", "final")]
    with pytest.raises(SignalAPIError) as caught:
        run.delete_checkpoint(adapter)
    assert caught.value.code == "NOT_FOUND"
