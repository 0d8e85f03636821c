"""Datums, losses, reductions, per-position outputs, forward and renderDatums over GraphQL and the SDK, on a live
server with a tiny real model."""

from __future__ import annotations

from typing import Any

import pytest

from rewardsignal import SignalClient, pack_datum
from rewardsignal.client import _batch as graphql_batch
from rewardsignal.errors import BadInputError
from tests.helpers.live_server import LiveServer, error_code

DATUMS: list[dict[str, Any]] = [
    {"model_input": [28120, 905, 314, 260], "loss_fn_inputs": {
        "target_tokens": [0, 0, 3575, 282], "advantages": [0.0, 0.0, 1.0, -0.5], "logprobs": [0.0, 0.0, -9.0, -8.5]}},
    {"model_input": [260, 3575], "loss_fn_inputs": {"target_tokens": [282, 905], "advantages": [0.0, 0.0],
                                                    "logprobs": [-9.0, -9.0]}},  # a group with equal rewards
]
FB = """mutation($id: ID!, $batch: [BatchItem!]!, $reduction: Reduction! = MEAN) {
  forwardBackward(runId: $id, batch: $batch, lossFn: PPO, reduction: $reduction) { loss numTokens reduction %s }
}"""


@pytest.fixture
def client(live_server: LiveServer, key: str) -> SignalClient:
    return SignalClient(api_key=key, base_url=live_server.url)


def test_outputs_are_computed_when_selected_and_only_then(live_server: LiveServer, key: str,
                                                         client: SignalClient) -> None:
    run = client.create_run(lora_r=4)
    plain = live_server.graphql(FB % "", {"id": run.id, "batch": graphql_batch(DATUMS)}, key=key)
    assert "errors" not in plain, plain
    assert plain["data"]["forwardBackward"]["numTokens"] == 2 and plain["data"]["forwardBackward"]["reduction"] == "mean"
    selected = live_server.graphql(FB % "outputs { logprobs elementwiseLoss }", {"id": run.id, "batch": graphql_batch(DATUMS)}, key=key)
    outputs = selected["data"]["forwardBackward"]["outputs"]
    assert [len(o["logprobs"]) for o in outputs] == [4, 2] and [len(o["elementwiseLoss"]) for o in outputs] == [4, 2]
    assert all(lp < 0 for o in outputs for lp in o["logprobs"])
    assert outputs[1]["elementwiseLoss"] == [0.0, 0.0]  # advantage 0 everywhere: nothing
    unselected = live_server.graphql(FB % "... on ForwardBackwardResult { step }", {"id": run.id, "batch": graphql_batch(DATUMS)},
                                     key=key)
    assert "outputs" not in unselected["data"]["forwardBackward"]
    # The SDK selects them with @include(if: $withOutputs).
    assert "outputs" not in run.forward_backward(DATUMS, loss_fn="ppo")
    with_outputs = run.forward_backward(DATUMS, loss_fn="ppo", return_outputs=True)
    assert [len(o["logprobs"]) for o in with_outputs["outputs"]] == [4, 2]
    # Metrics carry their reduction.
    assert len(run.metrics(name="loss:mean")) == 5 and run.metrics(name="loss") == []


def test_another_reduction_before_the_step_is_failed_precondition_naming_it(live_server: LiveServer, key: str,
                                                                           client: SignalClient) -> None:
    run = client.create_run(lora_r=4)
    summed = run.forward_backward(DATUMS, loss_fn="importance_sampling", reduction="sum")
    assert summed["reduction"] == "sum"
    body = live_server.graphql(FB % "", {"id": run.id, "batch": graphql_batch(DATUMS), "reduction": "MEAN"}, key=key)
    assert error_code(body) == "FAILED_PRECONDITION"
    assert body["errors"][0]["extensions"]["field"] == "reduction"
    run.optim_step()
    assert [m["value"] for m in run.metrics(name="loss:sum")] == [summed["loss"]]


def test_forward_returns_the_logprobs_forward_backward_trains_on_and_changes_nothing(client: SignalClient) -> None:
    run = client.create_run(lora_r=4)
    forward = run.forward(DATUMS, loss_fn="importance_sampling")
    assert forward["step"] == 0 and [len(o["logprobs"]) for o in forward["outputs"]] == [4, 2]
    assert run.refresh().info.get("pending_forward_backward", 0) in (0, None)
    trained = run.forward_backward(DATUMS, loss_fn="importance_sampling", return_outputs=True)
    for mine, theirs in zip(forward["outputs"], trained["outputs"]):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], rel=1e-6, abs=1e-6)
    base = client.forward(DATUMS, base_model=client.list_models()[0], loss_fn="importance_sampling")
    assert base["step"] is None
    assert base["outputs"] == forward["outputs"]  # a fresh run's B is 0: its logprobs are the base's


def test_render_datums_shows_the_token_level_form(client: SignalClient) -> None:
    run = client.create_run(lora_r=4)
    (datum,) = run.render_datums([{"tokens": [28120, 905, 314], "weights": [0, 1, 0.5]}])
    assert datum["model_input"] == [28120, 905]
    assert datum["loss_fn_inputs"]["target_tokens"] == [905, 314]
    assert datum["loss_fn_inputs"]["weights"] == [1.0, 0.5]
    (text,) = run.render_datums([{"text": "hello"}])
    assert len(text["model_input"]) == len(text["loss_fn_inputs"]["target_tokens"]) >= 1


@pytest.mark.parametrize(("item", "field"), [
    ({"modelInput": [1, 2], "lossFnInputs": {"targetTokens": [2]}}, "batch[0].lossFnInputs.targetTokens"),
    ({"modelInput": [1, 2], "lossFnInputs": {"targetTokens": [2, 10**7]}}, "batch[0].lossFnInputs.targetTokens"),
], ids=["lengths", "vocabulary"])
def test_bad_datums_name_their_field(live_server: LiveServer, key: str, client: SignalClient, item: dict,
                                     field: str) -> None:
    run = client.create_run(lora_r=4)
    body = live_server.graphql(FB % "", {"id": run.id, "batch": [item]}, key=key)
    assert error_code(body) == "BAD_INPUT", body
    assert body["errors"][0]["extensions"]["field"] == field


def test_forward_on_an_unknown_base_model_names_base_model(client: SignalClient) -> None:
    with pytest.raises(BadInputError) as caught:
        client.forward(DATUMS, base_model="no-such-model")
    assert caught.value.field == "baseModel"


def test_a_packed_batch_trains_as_the_same_datums(client: SignalClient) -> None:
    run = client.create_run(lora_r=4, seed=5)
    plain = run.forward(DATUMS, loss_fn="importance_sampling")
    packed = run.forward([pack_datum(d) for d in DATUMS], loss_fn="importance_sampling")
    assert packed["outputs"] == plain["outputs"] and packed["loss"] == plain["loss"]
    (rendered, _) = run.render_datums([pack_datum(d) for d in DATUMS])
    assert rendered["model_input"] == DATUMS[0]["model_input"]
    assert rendered["loss_fn_inputs"]["target_tokens"] == DATUMS[0]["loss_fn_inputs"]["target_tokens"]


@pytest.mark.parametrize("loss_fn", ["gspo", "stable_reinforce"])
def test_the_cookbooks_newer_losses_train_through_the_sdk(client: SignalClient, loss_fn: str) -> None:
    """No provenance on GraphQL: stable_reinforce's sampler logprobs are the datum's own (docs/LOSSES.md)."""
    run = client.create_run(lora_r=4, seed=5)
    datums = [{**d, "loss_fn_inputs": {**d["loss_fn_inputs"], "sequence_ratio_mask": [0.0, 0.0, 1.0, 1.0]}}
              for d in DATUMS[:1]]
    forward = run.forward(datums, loss_fn=loss_fn)
    learner = forward["outputs"][0]["logprobs"][2:]
    sampled, advantages = [-9.0, -8.5], [1.0, -0.5]
    if loss_fn == "stable_reinforce":  # -(min(r, 2) lp A), normalised by the 2 positions that carry an advantage
        expected = -sum(min(2.718281828 ** (lp - q), 2.0) * lp * a for lp, q, a in zip(learner, sampled, advantages)) / 2
    else:  # gspo: the sequence ratio over the mask, clipped to [1 - 3e-4, 1 + 4e-4], spread over its 2 positions
        s = 2.718281828 ** (sum(lp - q for lp, q in zip(learner, sampled)) / 2)
        expected = -sum(min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a) / 2 for a in advantages) / 2
    assert forward["loss"] == pytest.approx(expected, rel=1e-4)
    trained = run.forward_backward(datums, loss_fn=loss_fn)
    assert trained["loss"] == pytest.approx(forward["loss"], rel=1e-5)
    (rendered,) = run.render_datums(datums, loss_fn=loss_fn)
    assert rendered["loss_fn_inputs"]["sequence_ratio_mask"] == [0.0, 0.0, 1.0, 1.0]
