"""Over-bound calls are BAD_INPUT naming the field in the API's spelling, and never applied (docs/ERRORS.md#bounds).

Two real servers: one with the default bounds, which must refuse issue 19's sampling repros, and one with small
ones, so the runtime's own checks (text is counted only once tokenized) are reached with small calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from app.schema import schema
from app.schema.limits import PRIMITIVES
from gpu_runtime.contract import MAX_STOP, MAX_STOP_CHARS, MAX_TEMPERATURE, MAX_TOP_K
from tests.helpers.live_server import LiveServer, settings_for

SMALL = {"max_batch_size": 4, "max_batch_tokens": 64, "max_sample_rows": 8, "max_sample_prompt_tokens": 40,
         "max_sample_tokens": 64, "max_primitives_per_request": 2}
SAMPLE = ("mutation($r: ID!, $p: [String!], $t: [[Int!]!], $m: Int! = 1, $n: Int! = 1, $temp: Float! = 1, "
          "$k: Int! = 0, $stop: [String!], $stopTokens: [Int!]) { sample(runId: $r, prompts: $p, promptTokens: $t, "
          "maxTokens: $m, numSamples: $n, temperature: $temp, topK: $k, stop: $stop, stopTokens: $stopTokens) "
          "{ sequences { text } } }")
FORWARD_BACKWARD = "mutation($r: ID!, $b: [BatchItem!]!) { forwardBackward(runId: $r, batch: $b) { loss } }"
FORWARD = "mutation($b: [BatchItem!]!) { forward(baseModel: \"tiny-llama\", batch: $b) { loss } }"
CREATE = "mutation($i: CreateRunInput) { createRun(input: $i) { id } }"
OPTIM_STEP = "mutation($r: ID!, $a: AdamInput) { optimStep(runId: $r, adam: $a) { step } }"
METRICS = "query($r: ID!, $l: Int!) { run(id: $r) { metrics(limit: $l) { value } } }"
STEP = "query($r: ID!) { run(id: $r) { step metrics { name } } }"
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 12  # about 120 tokens: past 64, within the context


@pytest.fixture(scope="module")
def small_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-bounds"), tiny_model_dir, **SMALL))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_run(small_server: LiveServer) -> tuple[str, str]:
    key = small_server.new_user()
    created = small_server.graphql(CREATE, {"i": {"loraR": 2}}, key=key)
    assert "errors" not in created, created
    return created["data"]["createRun"]["id"], key


def refused(body: dict[str, Any]) -> str:
    """The field a BAD_INPUT answer names."""
    assert body.get("data") is None, body
    (error,) = body["errors"]
    assert error["extensions"]["code"] == "BAD_INPUT", error
    assert error["extensions"]["retryable"] is False
    return str(error["extensions"]["field"])


# ---- per-call sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(("variables", "field"), [
    ({"p": ["hi"] * 5000}, "prompts"),  # issue 19: 5,000 prompts x 1 token took 85.6 s
    ({"p": ["hi"], "n": 16, "m": 4096}, "maxTokens"),  # issue 19: 1 x 16 samples x 4,096 tokens, over 25 minutes
], ids=["5000-prompts", "16x4096-tokens"])
def test_the_default_bounds_refuse_the_sampling_repros(live_server: LiveServer, variables: dict[str, Any],
                                                       field: str) -> None:
    key = live_server.new_user()
    created = live_server.graphql(CREATE, {"i": {"loraR": 2}}, key=key)
    assert "errors" not in created, created
    run_id = created["data"]["createRun"]["id"]
    assert refused(live_server.graphql(SAMPLE, {"r": run_id, **variables}, key=key)) == field


@pytest.mark.parametrize(("variables", "field"), [
    ({"p": ["hi"] * 9}, "prompts"),  # 9 rows > 8
    ({"p": ["hi"] * 3, "n": 3}, "numSamples"),  # 9 rows, the prompts alone fit
    ({"p": ["hi"], "n": 8, "m": 9}, "maxTokens"),  # 72 generated tokens > 64
    ({"t": [[1] * 21], "n": 2}, "promptTokens"),  # 42 prompt tokens > 40, counted by the server
    ({"p": [LONG_TEXT]}, "prompts"),  # counted by the runtime, once tokenized
], ids=["rows", "rows-by-samples", "generated", "token-prompt", "text-prompt"])
def test_an_over_bound_sample_is_refused(small_server: LiveServer, small_run: tuple[str, str],
                                         variables: dict[str, Any], field: str) -> None:
    run_id, key = small_run
    assert refused(small_server.graphql(SAMPLE, {"r": run_id, **variables}, key=key)) == field


def test_a_sample_at_the_bounds_is_answered(small_server: LiveServer, small_run: tuple[str, str]) -> None:
    run_id, key = small_run
    body = small_server.graphql(SAMPLE, {"r": run_id, "p": ["hi"] * 4, "n": 2, "m": 8}, key=key)  # 8 rows, 64 tokens
    assert "errors" not in body, body
    assert [len(per_prompt) for per_prompt in body["data"]["sample"]["sequences"]] == [2] * 4


@pytest.mark.parametrize(("batch", "query"), [
    ([{"text": "a"}] * 5, FORWARD_BACKWARD),  # items, by the server
    ([{"tokens": list(range(65))}], FORWARD_BACKWARD),  # tokens of a token item, by the server
    ([{"text": LONG_TEXT}], FORWARD_BACKWARD),  # tokens of text, by the runtime
    ([{"text": LONG_TEXT}], FORWARD),  # forward on a base model, by the runtime
], ids=["items", "token-item", "text-item", "forward"])
def test_an_over_bound_batch_is_refused_and_not_applied(small_server: LiveServer, small_run: tuple[str, str],
                                                       batch: list[dict[str, Any]], query: str) -> None:
    run_id, key = small_run
    assert refused(small_server.graphql(query, {"r": run_id, "b": batch}, key=key)) == "batch"
    state = small_server.graphql(STEP, {"r": run_id}, key=key)["data"]["run"]
    assert state["metrics"] == []  # no forward_backward recorded, so none applied


# ---- number bounds -----------------------------------------------------------------------------


@pytest.mark.parametrize(("variables", "field"), [
    ({"temp": MAX_TEMPERATURE + 0.5}, "temperature"),
    ({"k": MAX_TOP_K + 1}, "topK"),
    ({"stop": ["x"] * (MAX_STOP + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stopTokens": list(range(MAX_STOP + 1))}, "stopTokens"),
], ids=["temperature", "top-k", "stop-count", "stop-length", "stop-token-count"])
def test_an_out_of_range_sampling_number_is_refused(small_server: LiveServer, small_run: tuple[str, str],
                                                    variables: dict[str, Any], field: str) -> None:
    run_id, key = small_run
    assert refused(small_server.graphql(SAMPLE, {"r": run_id, "p": ["hi"], **variables}, key=key)) == field


@pytest.mark.parametrize(("run_input", "field"), [
    ({"loraR": 4, "loraAlpha": 1e308}, "loraAlpha"),  # issue 19: the run's every loss was nan
    ({"loraR": 4, "loraAlpha": 65.0}, "loraAlpha"),  # past 16 * r
    ({"gradClipNorm": 1e6}, "gradClipNorm"),
], ids=["alpha-1e308", "alpha-over-16r", "grad-clip-norm"])
def test_an_out_of_range_run_setting_is_refused(small_server: LiveServer, run_input: dict[str, Any],
                                                field: str) -> None:
    key = small_server.new_user()
    assert refused(small_server.graphql(CREATE, {"i": run_input}, key=key)) == field
    assert small_server.graphql("{ runs { id } }", key=key)["data"]["runs"] == []


def test_an_out_of_range_grad_clip_norm_is_refused_at_optim_step(small_server: LiveServer,
                                                                 small_run: tuple[str, str]) -> None:
    run_id, key = small_run
    body = small_server.graphql(OPTIM_STEP, {"r": run_id, "a": {"gradClipNorm": 1e6}}, key=key)
    assert refused(body) == "adam.gradClipNorm"
    assert small_server.graphql(STEP, {"r": run_id}, key=key)["data"]["run"]["step"] == 0


@pytest.mark.parametrize("limit", [0, 10_001])
def test_an_out_of_range_metrics_limit_is_refused(small_server: LiveServer, small_run: tuple[str, str],
                                                  limit: int) -> None:
    run_id, key = small_run
    assert refused(small_server.graphql(METRICS, {"r": run_id, "l": limit}, key=key)) == "limit"


# ---- primitives per request ------------------------------------------------------------------

ALIASED_STEPS = ("mutation($r: ID!) { a: forwardBackward(runId: $r, batch: [{text: \"a b\"}]) { loss } "
                 "b: forwardBackward(runId: $r, batch: [{text: \"c d\"}]) { loss } ...more }"
                 "fragment more on Mutation { c: optimStep(runId: $r) { step } run: updateRun(runId: $r, note: \"x\") "
                 "{ id } }")


def test_every_primitive_is_a_mutation() -> None:
    assert schema._schema.mutation_type is not None
    assert PRIMITIVES <= set(schema._schema.mutation_type.fields)


def test_a_request_carrying_too_many_primitives_is_refused_before_any_runs(small_server: LiveServer) -> None:
    key = small_server.new_user()
    run_id = small_server.graphql(CREATE, {"i": {"loraR": 2}}, key=key)["data"]["createRun"]["id"]
    body = small_server.graphql(ALIASED_STEPS, {"r": run_id}, key=key)
    assert refused(body) == "c"  # the third primitive (through the fragment); updateRun is no primitive
    state = small_server.graphql(STEP, {"r": run_id}, key=key)["data"]["run"]
    assert state == {"step": 0, "metrics": []}  # neither forwardBackward ran


def test_a_request_at_the_primitives_bound_is_answered(small_server: LiveServer) -> None:
    key = small_server.new_user()
    run_id = small_server.graphql(CREATE, {"i": {"loraR": 2}}, key=key)["data"]["createRun"]["id"]
    # The same field twice under one response key is one call (GraphQL merges them), so this is two.
    at_bound = ALIASED_STEPS.replace("b: forwardBackward", "a: forwardBackward").replace("c d", "a b")
    body = small_server.graphql(at_bound, {"r": run_id}, key=key)
    assert "errors" not in body, body
    assert body["data"]["c"]["step"] == 1
