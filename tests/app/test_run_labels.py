"""A run's name, tags and note (issue 18 §1): set at createRun or by the SDK, changed by updateRun, searched and
sorted by the runs list; another user's run cannot be renamed. Real server, tiny model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, error_code

CREATE = "mutation($input: CreateRunInput) { createRun(input: $input) { id name tags note } }"
UPDATE = ("mutation($id: ID!, $name: String, $tags: [String!], $note: String) "
          "{ updateRun(runId: $id, name: $name, tags: $tags, note: $note) { id name tags note } }")
LIST = "query($search: String!, $sort: RunSort!) { runs(search: $search, sort: $sort) { name } }"


def create(live_server: LiveServer, key: str, **labels: object) -> dict:
    body = live_server.graphql(CREATE, {"input": {"loraR": 4, **labels}}, key=key)
    assert "errors" not in body, body
    return body["data"]["createRun"]


def test_a_run_without_a_name_gets_its_models_name_and_the_minute(live_server: LiveServer, key: str) -> None:
    run = create(live_server, key)
    short = TINY_MODEL.rsplit("/", 1)[-1]
    assert re.fullmatch(rf"{re.escape(short)} \d{{4}}-\d\d-\d\d \d\d:\d\d", run["name"]), run["name"]
    assert run["tags"] == [] and run["note"] == ""


def test_rename_tag_and_note_then_read_back(live_server: LiveServer, key: str) -> None:
    run = create(live_server, key, name="  first try  ", tags=["sft", "sft", " small "], note="lr sweep")
    assert (run["name"], run["tags"], run["note"]) == ("first try", ["sft", "small"], "lr sweep")

    renamed = live_server.graphql(UPDATE, {"id": run["id"], "name": "second try"}, key=key)
    assert "errors" not in renamed, renamed
    # Only the name changed: what was left out keeps its value.
    assert renamed["data"]["updateRun"] == {"id": run["id"], "name": "second try", "tags": ["sft", "small"],
                                            "note": "lr sweep"}
    retagged = live_server.graphql(UPDATE, {"id": run["id"], "tags": ["rl"], "note": ""}, key=key)
    assert "errors" not in retagged, retagged
    read = live_server.graphql("query($id: ID!) { run(id: $id) { name tags note } }", {"id": run["id"]}, key=key)
    assert "errors" not in read, read
    assert read["data"]["run"] == {"name": "second try", "tags": ["rl"], "note": ""}


def test_labels_out_of_bounds_are_refused_naming_the_field(live_server: LiveServer, key: str) -> None:
    run = create(live_server, key, name="bounded")
    cases: list[tuple[dict[str, Any], str]]
    cases = [({"name": " "}, "name"), ({"name": "n" * 201}, "name"), ({"tags": [f"t{i}" for i in range(21)]}, "tags"),
             ({"tags": ["x" * 41]}, "tags"), ({"note": "n" * 10_001}, "note")]
    for variables, field in cases:
        body = live_server.graphql(UPDATE, {"id": run["id"], **variables}, key=key)
        assert error_code(body) == "BAD_INPUT", body
        assert body["errors"][0]["extensions"]["field"] == field
    refused = live_server.graphql(CREATE, {"input": {"loraR": 4, "tags": ["y" * 41]}}, key=key)
    assert error_code(refused) == "BAD_INPUT", refused
    # At the bounds exactly, all is kept; NUL is stored as U+FFFD like other free text.
    at = live_server.graphql(UPDATE, {"id": run["id"], "name": "n" * 200, "tags": [f"t{i}" for i in range(20)],
                                      "note": "a\x00b" + "n" * 9_997}, key=key)
    assert "errors" not in at, at
    assert len(at["data"]["updateRun"]["name"]) == 200 and len(at["data"]["updateRun"]["tags"]) == 20
    assert at["data"]["updateRun"]["note"].startswith("a\ufffdb")


def test_another_user_cannot_rename_your_run(live_server: LiveServer, key: str) -> None:
    run = create(live_server, key, name="mine")
    other = live_server.new_user()
    body = live_server.graphql(UPDATE, {"id": run["id"], "name": "theirs"}, key=other)
    assert error_code(body) == "NOT_FOUND", body
    read = live_server.graphql("query($id: ID!) { run(id: $id) { name } }", {"id": run["id"]}, key=key)
    assert read["data"]["run"]["name"] == "mine"
    assert live_server.graphql(LIST, {"search": "mine", "sort": "NEWEST"}, key=other)["data"]["runs"] == []


def test_runs_search_names_tags_and_base_model_and_sorts(live_server: LiveServer, key: str) -> None:
    for name, tags in (("beta", ["Sweep-A"]), ("alpha", ["café"]), ("gamma 100%", ["sweep-b"])):
        create(live_server, key, name=name, tags=tags)

    def names(search: str, sort: str = "NEWEST") -> list[str]:
        body = live_server.graphql(LIST, {"search": search, "sort": sort}, key=key)
        assert "errors" not in body, body
        return [run["name"] for run in body["data"]["runs"]]

    assert names("") == ["gamma 100%", "alpha", "beta"]
    assert names("", "OLDEST") == ["beta", "alpha", "gamma 100%"]
    assert names("", "NAME") == ["alpha", "beta", "gamma 100%"]
    assert names("SWEEP") == ["gamma 100%", "beta"]  # a tag, in any case
    assert names("alp") == ["alpha"]
    assert names("fé") == ["alpha"]  # a tag's own characters, not its JSON escape
    assert names("0%") == ["gamma 100%"]  # % is a character here, not a wildcard
    assert names("_") == []
    assert len(names(TINY_MODEL.rsplit("/", 1)[-1].upper())) == 3  # the base model


def test_sdk_names_updates_and_searches(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4, name="sdk run", tags=["sdk"], note="made by the SDK")
    assert run.name == "sdk run" and run.info["tags"] == ["sdk"] and run.info["note"] == "made by the SDK"
    assert run.update(name="renamed", tags=["sdk", "v2"]) is run
    assert run.name == "renamed" and run.info["note"] == "made by the SDK"
    assert client.get_run(run.id).info["tags"] == ["sdk", "v2"]
    client.create_run(lora_r=4, name="other")
    assert [r.name for r in client.list_runs(search="v2")] == ["renamed"]
    assert [r.name for r in client.list_runs(sort="name")] == ["other", "renamed"]


ARCHIVE = "mutation($id: ID!) { archiveRun(runId: $id) { name archivedAt } }"
UNARCHIVE = "mutation($id: ID!) { unarchiveRun(runId: $id) { name archivedAt } }"
FB = ('mutation($id: ID!) { forwardBackward(runId: $id, batch: [{input: "The quick", output: " fox"}]) '
      "{ step } }")
SAMPLE = 'mutation($id: ID!) { sample(runId: $id, prompts: ["The"], maxTokens: 2) { outputs } }'


def test_an_archived_run_is_hidden_and_refuses_training_until_unarchived(live_server: LiveServer, key: str,
                                                                        tmp_path: Path) -> None:
    run = create(live_server, key, name="old")
    sdk_run = SignalClient(api_key=key, base_url=live_server.url).get_run(run["id"])
    saved = sdk_run.save_state(mode="adapter")
    kept = {path.relative_to(saved.checkpoint_path) for path in Path(saved.checkpoint_path).rglob("*") if path.is_file()}
    create(live_server, key, name="current")
    archived = live_server.graphql(ARCHIVE, {"id": run["id"]}, key=key)
    assert "errors" not in archived, archived
    assert archived["data"]["archiveRun"]["archivedAt"] is not None

    def names(archived: bool | None) -> list[str]:
        body = live_server.graphql("query($a: Boolean) { runs(archived: $a) { name } }", {"a": archived}, key=key)
        assert "errors" not in body, body
        return [r["name"] for r in body["data"]["runs"]]

    assert names(False) == ["current"]
    assert names(True) == ["old"]
    assert names(None) == ["current", "old"]
    for operation in (FB, SAMPLE):
        refused = live_server.graphql(operation, {"id": run["id"]}, key=key)
        assert error_code(refused) == "FAILED_PRECONDITION", refused
        assert "archived" in refused["errors"][0]["message"]
    # Its files are kept: its checkpoint still lists, is on disk, and downloads whole.
    assert [checkpoint.id for checkpoint in sdk_run.checkpoints()] == [saved.id]
    assert kept and (Path(saved.checkpoint_path) / "adapter_config.json").is_file()
    fetched = saved.download(tmp_path / "fetched")
    assert {path.relative_to(fetched) for path in fetched.rglob("*") if path.is_file()} == kept
    # Its history is kept, and a stranger can neither archive nor unarchive it.
    other = live_server.new_user()
    assert error_code(live_server.graphql(UNARCHIVE, {"id": run["id"]}, key=other)) == "NOT_FOUND"

    unarchived = live_server.graphql(UNARCHIVE, {"id": run["id"]}, key=key)
    assert unarchived["data"]["unarchiveRun"] == {"name": "old", "archivedAt": None}
    trained = live_server.graphql(FB, {"id": run["id"]}, key=key)
    assert "errors" not in trained, trained
    assert names(False) == ["current", "old"]


def test_sdk_archives_and_unarchives(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4, name="to archive")
    assert run.archive() is run and run.info["archived_at"] is not None
    assert client.list_runs() == []
    assert [r.name for r in client.list_runs(archived=True)] == ["to archive"]
    assert [r.name for r in client.list_runs(archived=None)] == ["to archive"]
    run.unarchive()
    assert run.info["archived_at"] is None and [r.id for r in client.list_runs()] == [run.id]
