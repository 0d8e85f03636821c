"""Bodies that are not a GraphQL request object get 400 in GraphQL's error shape, before authentication (no key is
sent): never a 500, never strawberry's plain text. Tinker's wire and /v1 answer theirs in their own shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

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



# ---- Tinker's wire (/api/v1) and OpenAI's (/v1): each answers a malformed body in its own shape (issue 34, #4 #5 #18)

DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
CHUNK = {"type": "encoded_text", "tokens": [100, 101]}


def tinker_cases() -> list[Any]:
    """(path, body, the field the refusal names): ids and names need not exist, the body's types are checked first."""
    sample = {"sampling_session_id": "s", "seq_id": 1, "num_samples": 1, "prompt": {"chunks": [CHUNK]},
              "sampling_params": {"max_tokens": 1}}
    model = {"session_id": "s", "model_seq_id": 0, "base_model": "tiny-llama"}
    cases = [
        ("asample", {**sample, "prompt": "abc"}, "prompt"),
        ("asample", {**sample, "prompt": [1, 2]}, "prompt"),
        ("asample", {**sample, "prompt": {"chunks": "abc"}}, "prompt.chunks"),
        ("asample", {**sample, "prompt": {"chunks": [1, 2]}}, "prompt.chunks[0]"),
        ("asample", {**sample, "prompt": {"chunks": [{"tokens": ["a"]}]}}, "prompt.chunks[0].tokens[0]"),
        ("asample", {**sample, "sampling_params": [1]}, "sampling_params"),
        ("asample", {**sample, "sampling_params": {"max_tokens": "many"}}, "sampling_params.max_tokens"),
        ("asample", {**sample, "prompt_logprobs": "yes"}, "prompt_logprobs"),
        ("create_model", {**model, "optimizer_config": "sgd"}, "optimizer_config"),
        ("create_model", {**model, "lora_config": [4]}, "lora_config"),
        ("create_model", {**model, "lora_config": "rank 4"}, "lora_config"),
        ("create_model", {**model, "lora_config": {"train_mlp": "no"}}, "lora_config.train_mlp"),
        ("create_model", {**model, "model_seq_id": 2**70}, "model_seq_id"),
        ("create_session", {"tags": [], "display_name": 12345}, "display_name"),
        ("optim_step", {"model_id": "m", "seq_id": 1, "adam_params": "fast"}, "adam_params"),
        ("optim_step", {"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": "1e-3"}},
         "adam_params.learning_rate"),
        ("save_weights", {"model_id": "m", "seq_id": 1, "path": "w1", "overwrite": "no"}, "overwrite"),
        ("load_weights", {"path": "tinker://m/weights/w1", "optimizer": 1, "model_id": "m", "seq_id": 1},
         "optimizer"),
    ]
    return [pytest.param(path, json.dumps(body).encode(), field, id=f"{path}-{field}-{i}")
            for i, (path, body, field) in enumerate(cases)] + [
        pytest.param("create_session", DEEP, "body", id="nested-100000"),
        pytest.param("create_session", b'{"display_name": "\xff"}', "body", id="invalid-utf8")]


@pytest.mark.parametrize(("path", "body", "field"), tinker_cases())
def test_a_malformed_tinker_body_is_a_json_400_naming_the_field(live_server: LiveServer, path: str, body: bytes,
                                                                field: str) -> None:
    pid = live_server.worker_pid
    headers = {"X-API-Key": "tml-" + live_server.new_user(), **JSON}
    with httpx.Client(base_url=f"{live_server.url}/api/v1", headers=headers, timeout=60) as client:
        answer = client.post(path, content=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["category"] == "user" and field in answer.json()["detail"]
        assert client.get("healthz").json() == {"status": "ok"}  # the same keep-alive connection answers on
    assert live_server.worker_pid == pid


@pytest.mark.parametrize(("body", "says"), [(DEEP, "nested too deeply"), (b'{"model": "\xff"}', "not valid JSON")],
                         ids=["nested-100000", "invalid-utf8"])
def test_a_malformed_v1_body_is_openais_400(live_server: LiveServer, key: str, body: bytes, says: str) -> None:
    answer = httpx.post(f"{live_server.url}/v1/chat/completions", content=body, timeout=60,
                        headers={"Authorization": f"Bearer {key}", **JSON})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "body" and says in error["message"]


@pytest.mark.parametrize("prefix", ["/v1/completions", "/api/v1/create_session", "/graphql"])
def test_a_declared_over_size_body_is_refused_in_its_wires_shape(live_server: LiveServer, prefix: str) -> None:
    """One 413 per wire, before parsing (#15): OpenAI's error, Tinker's {detail, category}, GraphQL's errors."""
    limit = live_server.settings.max_request_bytes
    answer = httpx.post(f"{live_server.url}{prefix}", content=b"x" * (limit + 1), headers=JSON, timeout=60)
    assert answer.status_code == 413
    shape = answer.json()
    if prefix.startswith("/v1"):
        assert shape["error"]["code"] == "request_too_large"
    elif prefix.startswith("/api"):
        assert shape["category"] == "user" and str(limit) in shape["detail"]
    else:
        assert shape["errors"][0]["extensions"]["code"] == "PAYLOAD_TOO_LARGE"


def test_a_streamed_over_size_tinker_body_is_tinkers_413(live_server: LiveServer) -> None:
    limit = live_server.settings.max_request_bytes

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bytes are counted as they come
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536

    answer = httpx.post(f"{live_server.url}/api/v1/create_session", content=chunks(), timeout=60,
                        headers={"X-API-Key": "tml-" + live_server.new_user(), **JSON})
    assert answer.status_code == 413 and answer.json()["category"] == "user"


def test_a_huge_checkpoint_id_is_not_found(live_server: LiveServer, key: str) -> None:
    """99999999999999999999999 overflows the database's integers: NOT_FOUND, never INTERNAL (#9)."""
    run = live_server.graphql('mutation { createRun(input: {loraR: 4}) { id } }', key=key)["data"]["createRun"]["id"]
    body = live_server.graphql('mutation($r: ID!) { deleteCheckpoint(runId: $r, checkpointId: "99999999999999999999999") }',
                               {"r": run}, key=key)
    (error,) = body["errors"]
    assert error["extensions"]["code"] == "NOT_FOUND"
