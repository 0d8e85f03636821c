"""Sampler snapshots through GraphQL and the SDK, against a live server and runtime: saved, sampled without the run's
lock or history, listed, downloaded, and hidden from other users; base-model samples with no run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewardsignal import NotFoundError, SignalClient
from tests.helpers.live_server import LiveServer, error_code

BATCH = [{"input": "Q: What is 2 + 2?\nA:", "output": " 4"}, {"text": "The quick brown fox jumps over the lazy dog."}]
SAMPLE = ("mutation($runId: ID, $snapshot: String, $baseModel: String) { sample(runId: $runId, snapshot: $snapshot, "
          "baseModel: $baseModel, prompts: [\"hi\"], maxTokens: 4, temperature: 0) { sequences { tokens } step } }")


def trained(client: SignalClient):  # type: ignore[no-untyped-def]
    run = client.create_run(lora_r=4, lora_alpha=8, seed=3)
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=5e-2)
    return run


def test_a_named_snapshot_is_sampled_listed_and_downloaded(live_server: LiveServer, tmp_path: Path) -> None:
    client = SignalClient(api_key=live_server.new_user(), base_url=live_server.url)
    run = trained(client)
    saved = run.save_weights_for_sampler("final")
    assert saved["name"] == "final" and saved["named"] and saved["step"] == 1 and saved["expires_in_seconds"] is None
    frozen = run.sample(["hi"], max_tokens=4, temperature=0, snapshot="final")
    assert frozen["sequences"][0][0]["tokens"] == run.sample(["hi"], max_tokens=4, temperature=0)["sequences"][0][0]["tokens"]
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=5e-2)
    again = run.sample(["hi"], max_tokens=4, temperature=0, snapshot="final")
    # The same answer; logprobs within 1e-4 (the prompt's KV may now come from the decode cache, a prefill of other shape).
    for seen, first in zip(again["sequences"][0], frozen["sequences"][0], strict=True):
        assert {k: v for k, v in seen.items() if k != "logprobs"} == {k: v for k, v in first.items() if k != "logprobs"}
        assert seen["logprobs"] == pytest.approx(first["logprobs"], abs=1e-4)
    assert len(run.samples()) == 1  # the current-weights sample is stored; snapshot samples are not by default

    listed = run.snapshots()
    assert [(s["name"], s["mode"], s["step"]) for s in listed] == [("final", "sampler", 1)]
    assert [c["name"] for c in run.checkpoints() if c["mode"] == "sampler"] == ["final"]
    target = listed[0].download(tmp_path / "snap")
    assert (target / "adapter_model.safetensors").is_file() and (target / "adapter_config.json").is_file()


def test_another_users_snapshot_is_not_found(live_server: LiveServer) -> None:
    owner = SignalClient(api_key=live_server.new_user(), base_url=live_server.url)
    run = trained(owner)
    name = run.save_weights_for_sampler()["name"]  # unnamed: a generated name
    assert run.sample(["hi"], max_tokens=2, snapshot=name)["sequences"]
    other = live_server.new_user()
    body = live_server.graphql(SAMPLE, {"runId": run.id, "snapshot": name}, key=other)
    assert error_code(body) == "NOT_FOUND" and body["errors"][0]["extensions"]["field"] == "runId"
    missing = live_server.graphql(SAMPLE, {"runId": run.id, "snapshot": "never-made"}, key=owner.api_key)
    assert error_code(missing) == "NOT_FOUND" and "save_weights_for_sampler" in missing["errors"][0]["message"]


def test_a_base_model_sample_needs_no_run(live_server: LiveServer) -> None:
    key = live_server.new_user()
    body = live_server.graphql(SAMPLE, {}, key=key)  # no runId, no baseModel: the server's default model
    assert "errors" not in body, body
    fresh = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, lora_alpha=8, seed=3)
    untrained = fresh.sample(["hi"], max_tokens=4, temperature=0)  # B = 0: the base's own tokens
    assert body["data"]["sample"]["sequences"][0][0]["tokens"] == untrained["sequences"][0][0]["tokens"]
    with pytest.raises(NotFoundError):
        fresh.sample(["hi"], max_tokens=2, snapshot="nope")


def test_a_forward_on_a_snapshot_and_deleting_its_row(live_server: LiveServer) -> None:
    client = SignalClient(api_key=live_server.new_user(), base_url=live_server.url)
    run = trained(client)
    datums = [{"model_input": [1, 2, 3, 4], "loss_fn_inputs": {"target_tokens": [2, 3, 4, 5], "weights": [1, 1, 1, 1]}}]
    at_save = run.forward(datums)
    run.save_weights_for_sampler("frozen")
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=5e-2)
    frozen = run.forward(datums, snapshot="frozen")
    assert frozen["step"] == 1 and run.forward(datums)["step"] == 2
    assert frozen["outputs"][0]["logprobs"] == pytest.approx(at_save["outputs"][0]["logprobs"], abs=1e-5)
    row = next(c for c in run.checkpoints() if c["mode"] == "sampler")
    assert row["path"] == f"signal://{run.id}/sampler/frozen"
    run.delete_checkpoint(row)
    assert run.snapshots() == []
    with pytest.raises(NotFoundError):
        run.forward(datums, snapshot="frozen")
