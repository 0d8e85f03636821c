"""The four primitives over GraphQL against a tiny real model: on the local worker, and on the Modal backend's
offline path (the same runtime in a Modal class run by `.local()`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, error_code
from tests.helpers.modal_server import (  # noqa: F401 - live_server_on_both_backends: every test on both backends
    LOCAL_WARNING,
    live_server_on_both_backends,
    runtime_data_dir,
)

pytestmark = pytest.mark.filterwarnings(LOCAL_WARNING)


BATCH = [
    {"input": "The quick brown fox", "output": " jumps over the lazy dog."},
    {"text": "Machine learning is transforming technology."},
]

CREATE = "mutation($input: CreateRunInput) { createRun(input: $input) { id step loraR loraAlpha gpuConfig trainableParams } }"
FB = "mutation($id: ID!, $batch: [BatchItem!]!) { forwardBackward(runId: $id, batch: $batch) { loss numTokens numExamples step } }"
OPT = "mutation($id: ID!) { optimStep(runId: $id, adam: {learningRate: 0.01}) { step gradNorm learningRate } }"


def create_run(live_server: LiveServer, key: str, **spec: object) -> str:
    body = live_server.graphql(CREATE, {"input": {"loraR": 8, **spec}}, key=key)
    assert "errors" not in body, body
    return body["data"]["createRun"]["id"]


def test_train_sample_save_and_read_back(live_server: LiveServer, key: str) -> None:
    created = live_server.graphql(CREATE, {"input": {"loraR": 8, "seed": 3}}, key=key)
    assert "errors" not in created, created
    run = created["data"]["createRun"]
    assert run["step"] == 0 and run["loraR"] == 8 and run["loraAlpha"] == 16
    assert run["gpuConfig"] == "L40S:1" and run["trainableParams"] > 0

    losses = []
    for step in range(4):
        fb = live_server.graphql(FB, {"id": run["id"], "batch": BATCH}, key=key)
        assert "errors" not in fb, fb
        assert fb["data"]["forwardBackward"]["numExamples"] == 2
        assert fb["data"]["forwardBackward"]["step"] == step
        losses.append(fb["data"]["forwardBackward"]["loss"])
        opt = live_server.graphql(OPT, {"id": run["id"]}, key=key)
        assert "errors" not in opt, opt
        assert opt["data"]["optimStep"]["step"] == step + 1
        assert opt["data"]["optimStep"]["learningRate"] == 0.01
    assert losses[-1] < losses[0]

    sampled = live_server.graphql(
        'mutation($id: ID!) { sample(runId: $id, prompts: ["The quick", "Machine"], maxTokens: 5, temperature: 0) '
        "{ outputs sequences { text tokens logprobs stopReason } } }", {"id": run["id"]}, key=key)
    assert "errors" not in sampled, sampled
    outputs = sampled["data"]["sample"]["outputs"]
    sequences = sampled["data"]["sample"]["sequences"]
    assert len(outputs) == 2 and [s[0]["text"] for s in sequences] == outputs
    for per_prompt in sequences:
        assert len(per_prompt[0]["tokens"]) == len(per_prompt[0]["logprobs"]) <= 5
        assert per_prompt[0]["stopReason"] in ("stop", "length")

    saved = live_server.graphql('mutation($id: ID!) { saveState(runId: $id, mode: ADAPTER) '
                                "{ checkpointPath mode step sizeBytes } }", {"id": run["id"]}, key=key)
    assert "errors" not in saved, saved
    checkpoint = saved["data"]["saveState"]
    assert checkpoint["mode"] == "adapter" and checkpoint["step"] == 4
    assert Path(checkpoint["checkpointPath"]).is_dir() and checkpoint["sizeBytes"] > 0
    assert str(runtime_data_dir(live_server).resolve()) in os.path.realpath(checkpoint["checkpointPath"])

    read = live_server.graphql(
        'query($id: ID!) { run(id: $id) { step createdAt metrics(name: "loss:mean") { step value createdAt } '
        "samples { prompt output step } checkpoints { mode step checkpointPath } } }", {"id": run["id"]}, key=key)
    assert "errors" not in read, read
    stored = read["data"]["run"]
    assert stored["step"] == 4
    # Times read back from the database are UTC and say so, on SQLite as on PostgreSQL.
    assert stored["createdAt"].endswith("+00:00") and stored["metrics"][0]["createdAt"].endswith("+00:00")
    last_two = live_server.graphql('query($id: ID!) { run(id: $id) { metrics(name: "loss:mean", limit: 2) { step } } }',
                                   {"id": run["id"]}, key=key)["data"]["run"]["metrics"]
    assert [m["step"] for m in last_two] == [2, 3]
    assert [m["value"] for m in stored["metrics"]] == losses
    assert [m["step"] for m in stored["metrics"]] == [0, 1, 2, 3]
    assert sorted(s["prompt"] for s in stored["samples"]) == ["Machine", "The quick"]
    assert sorted(s["output"] for s in stored["samples"]) == sorted(outputs)
    assert stored["checkpoints"] == [{"mode": "adapter", "step": 4, "checkpointPath": checkpoint["checkpointPath"]}]

    runs = live_server.graphql("{ runs { id } }", key=key)["data"]["runs"]
    assert [r["id"] for r in runs] == [run["id"]]


def test_bad_input_names_the_field(live_server: LiveServer, key: str) -> None:
    for spec, field in [({"loraR": 0}, "loraR"), ({"loraR": 8, "loraDropout": 1.5}, "loraDropout"),
                        ({"baseModel": "no/such-model"}, "baseModel"), ({"gpuConfig": "Z80:2"}, "gpuConfig"),
                        ({"gpuConfig": "H100:99"}, "gpuConfig"), ({"learningRate": -1.0}, "learningRate")]:
        body = live_server.graphql(CREATE, {"input": spec}, key=key)
        assert error_code(body) == "BAD_INPUT", (spec, body)
        assert body["errors"][0]["extensions"]["field"] == field

    run_id = create_run(live_server, key)
    empty_item = live_server.graphql(FB, {"id": run_id, "batch": [{"text": "fine"}, {}]}, key=key)
    assert error_code(empty_item) == "BAD_INPUT"
    assert empty_item["errors"][0]["extensions"]["field"].startswith("batch[1]")

    unknown_key = live_server.graphql(FB, {"id": run_id, "batch": [{"text": "a"}, {"prompt": "b"}]}, key=key)
    assert error_code(unknown_key) == "BAD_INPUT"
    assert "prompt" in unknown_key["errors"][0]["message"] and "[1]" in unknown_key["errors"][0]["message"]

    too_many = live_server.graphql(FB, {"id": run_id, "batch": [{"text": "x"}] * 17}, key=key)
    assert error_code(too_many) == "BAD_INPUT"

    overflowing = live_server.graphql(FB, {"id": run_id, "batch": [{"tokens": [1, 2, 3], "weights": [0, 1e39, 1e39]}]},
                                      key=key)
    assert error_code(overflowing) == "BAD_INPUT" and overflowing["errors"][0]["extensions"]["field"] == "batch"

    no_gradients = live_server.graphql(OPT, {"id": run_id}, key=key)  # nothing above accumulated anything
    assert error_code(no_gradients) == "FAILED_PRECONDITION"

    bad_sample = live_server.graphql('mutation($id: ID!) { sample(runId: $id, prompts: ["x"], temperature: -1) '
                                     "{ outputs } }", {"id": run_id}, key=key)
    assert error_code(bad_sample) == "BAD_INPUT"
    assert bad_sample["errors"][0]["extensions"]["field"] == "temperature"
    too_long = live_server.graphql('mutation($id: ID!) { sample(runId: $id, prompts: ["x"], maxTokens: 5000) '
                                   "{ outputs } }", {"id": run_id}, key=key)
    assert error_code(too_long) == "BAD_INPUT" and too_long["errors"][0]["extensions"]["field"] == "maxTokens"
    bad_module = live_server.graphql(CREATE, {"input": {"loraTargetModules": ["no_such_proj"]}}, key=key)
    assert error_code(bad_module) == "BAD_INPUT"
    assert bad_module["errors"][0]["extensions"]["field"] == "loraTargetModules"
    assert "no_such_proj" in bad_module["errors"][0]["message"]


def test_model_that_is_not_on_this_machine_is_unavailable(live_server: LiveServer, key: str) -> None:
    body = live_server.graphql(CREATE, {"input": {"baseModel": "meta-llama/Llama-3.2-1B"}}, key=key)
    assert error_code(body) == "MODEL_UNAVAILABLE"
    assert "Llama-3.2-1B" in body["errors"][0]["message"]
    assert live_server.graphql("{ runs { id } }", key=key)["data"]["runs"] == []


def test_delete_run_removes_it_and_its_files(live_server: LiveServer, key: str) -> None:
    run_id = create_run(live_server, key)
    live_server.graphql(FB, {"id": run_id, "batch": BATCH}, key=key)
    live_server.graphql(OPT, {"id": run_id}, key=key)
    run_dirs = list(runtime_data_dir(live_server).glob(f"runs/*/{run_id}"))
    assert len(run_dirs) == 1
    body = live_server.graphql('mutation($id: ID!) { deleteRun(runId: $id) }', {"id": run_id}, key=key)
    assert body == {"data": {"deleteRun": True}}
    assert error_code(live_server.graphql('query($id: ID!) { run(id: $id) { id } }', {"id": run_id}, key=key)) == "NOT_FOUND"
    assert not run_dirs[0].exists()


def test_a_run_whose_files_are_gone_can_still_be_deleted(live_server: LiveServer, key: str) -> None:
    import shutil

    run_id = create_run(live_server, key)
    [run_dir] = runtime_data_dir(live_server).glob(f"runs/*/{run_id}")
    live_server.graphql('mutation($id: ID!) { saveState(runId: $id) { step } }', {"id": run_id}, key=key)
    shutil.rmtree(run_dir)
    live_server.graphql("mutation { createApiKey { secret } }", key=key)  # any other call in between
    body = live_server.graphql('mutation($id: ID!) { deleteRun(runId: $id) }', {"id": run_id}, key=key)
    assert body == {"data": {"deleteRun": True}}
    assert live_server.graphql("{ runs { id } }", key=key)["data"]["runs"] == []


def test_another_users_run_is_not_found_for_every_operation(live_server: LiveServer, key: str) -> None:
    run_id = create_run(live_server, key)
    intruder = live_server.new_user()
    operations = [
        ('query($id: ID!) { run(id: $id) { id } }', {}),
        (FB, {"batch": BATCH}),
        (OPT, {}),
        ('mutation($id: ID!) { sample(runId: $id, prompts: ["x"]) { outputs } }', {}),
        ('mutation($id: ID!) { saveState(runId: $id) { checkpointPath } }', {}),
        ('mutation($id: ID!) { deleteRun(runId: $id) }', {}),
    ]
    for query, extra in operations:
        body = live_server.graphql(query, {"id": run_id, **extra}, key=intruder)
        assert error_code(body) == "NOT_FOUND", (query, body)
        assert body.get("data") in (None, {}) or not any(body["data"].values())
    assert live_server.graphql("{ runs { id } }", key=intruder)["data"]["runs"] == []
    # The owner's run is untouched: no gradients were accumulated by the intruder's forwardBackward.
    assert error_code(live_server.graphql(OPT, {"id": run_id}, key=key)) == "FAILED_PRECONDITION"
    assert live_server.graphql('query($id: ID!) { run(id: $id) { step } }', {"id": run_id}, key=key)["data"]["run"]["step"] == 0


@pytest.mark.parametrize("run_id", ["a\x00b", "x" * 100], ids=["nul", "over-long"])
def test_an_id_no_run_could_have_is_not_found(live_server: LiveServer, key: str, run_id: str) -> None:
    # PostgreSQL refuses NUL in a query parameter: such an id must be NOT_FOUND on every database, never INTERNAL.
    body = live_server.graphql('query($id: ID!) { run(id: $id) { id } }', {"id": run_id}, key=key)
    assert error_code(body) == "NOT_FOUND", body
    assert error_code(live_server.graphql(OPT, {"id": run_id}, key=key)) == "NOT_FOUND"


def test_sdk_drives_the_same_server(live_server: LiveServer, key: str) -> None:
    with SignalClient(api_key=key, base_url=live_server.url) as client:
        assert "tiny-llama" in client.list_models()
        run = client.create_run(lora_r=4, learning_rate=0.01)
        result = run.forward_backward(batch=BATCH)
        assert result["loss"] == result.loss > 0
        assert run.optim_step().step == 1
        assert client.get_run(run.id).step == 1


def test_a_sample_with_a_nul_character_is_answered_and_kept(live_server: LiveServer, key: str) -> None:
    # SmolLM2's byte-level token 190 decodes to NUL, which PostgreSQL's text cannot hold: teach the run to emit it.
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=8, seed=1)
    for _ in range(20):  # the tiny random model's logits are near flat: a few big steps move its argmax
        run.forward_backward(batch=[{"input": "zero\x00", "output": "\x00" * 16}])
        run.optim_step(learning_rate=0.2)
    answer = run.sample(prompts=["zero\x00"], max_tokens=4, temperature=0.0)
    output = answer.sequences[0][0].text
    assert "\x00" in output  # the caller gets the model's text exactly
    stored = run.samples()[0]
    assert stored["prompt"] == "zero\ufffd"  # kept, with NUL shown as U+FFFD on every database
    assert stored["output"] == output.replace("\x00", "\ufffd")
