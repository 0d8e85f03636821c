"""Server-side custom losses through the real tinker SDK (docs/LOSSES.md): `create_custom_loss` uploads a traced loss,
`forward_backward_custom` with its handle runs it in Signal's pass, and the result equals the same loss run
client-side (the SDK's two-call path), loss, metrics and gradients; graphs off Signal's list are a 400 naming the node,
and another user's loss_id is not found."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest
import torch

from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.test_wire import TOKENS, as_list

RANKS = {"logprobs": 1, "sampling_logprobs": 1, "advantages": 1}


def ppo_clip(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor) -> Any:
    """A PPO-like clipped ratio, as the SDK's users write a loss (one datum at a time)."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean().detach(), "custom/clipped:sum": (ratio != clipped).float().sum()}


def data() -> list[Any]:
    from tinker import types

    out = []
    for shift, advantage in ((0, 1.0), (2, -0.5), (4, 2.0)):
        tokens = TOKENS[shift:shift + 6]
        n = len(tokens) - 1
        inputs: dict[str, Any] = {  # lists: Datum converts them to TensorData
            "target_tokens": tokens[1:],  # a key of the loss's own is TensorData (the SDK types only its own keys)
            "sampling_logprobs": types.TensorData(data=[-9.0 + 0.3 * i for i in range(n)], dtype="float32", shape=[n]),
            "advantages": [advantage] * n}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return out


def test_a_server_side_loss_equals_the_same_loss_run_client_side(service_client: Any) -> None:
    from tinker import types

    handle = service_client.create_custom_loss(ppo_clip, RANKS).result()
    assert handle.loss_id is not None  # uploaded: client/config says custom_loss_server_side
    local = dataclasses.replace(handle, loss_id=None)  # the same traced loss, run by the SDK itself
    server_side = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=11).result()
    client_side = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=11).result()
    results, norms = [], []
    for training, loss in ((server_side, handle), (client_side, local)):
        results.append(training.forward_backward_custom(data(), loss).result())
        step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        norms.append(step.metrics["optim/grad_norm"])
    served, reference = results
    for key in ("loss:sum", "custom/ratio:mean", "custom/clipped:sum"):
        assert served.metrics[key] == pytest.approx(reference.metrics[key], rel=1e-5, abs=1e-5), key
    assert norms[0] > 0 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    # The step moved both runs alike: their logprobs after it agree.
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data()]
    after = [training.forward(plain, "cross_entropy").result() for training in (server_side, client_side)]
    for a, b in zip(after[0].loss_fn_outputs, after[1].loss_fn_outputs):
        assert as_list(a["logprobs"]) == pytest.approx(as_list(b["logprobs"]), abs=1e-5)


def weighted_nll(logprobs: torch.Tensor, advantages: torch.Tensor) -> Any:
    loss = -(logprobs * advantages).sum()
    return loss, {"custom/neg_ll:sum": loss}


def test_another_users_loss_id_is_not_found(live_server: LiveServer, service_client: Any) -> None:
    import tinker

    owned = service_client.create_custom_loss(weighted_nll, {"logprobs": 1, "advantages": 1}).result()
    assert owned.loss_id is not None
    other = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + live_server.new_user())
    training = other.create_lora_training_client(base_model=TINY_MODEL, rank=8).result()
    with pytest.raises(Exception, match="not found"):
        training.forward_backward(data()[:1], "custom", {"loss_id": owned.loss_id}).result()


def node(op: str, name: str, target: str, *args: Any) -> dict[str, Any]:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


def graph(*middle: dict[str, Any], result: str = "loss") -> dict[str, Any]:
    return {"format": 1, "nodes": [node("placeholder", "logprobs", "logprobs"), *middle,
                                   node("output", "output", "output", {"tuple": [{"ref": result}, {"dict": {}}]})]}


REFUSED = {
    "open": (graph(node("call_function", "loss", "builtins.open", "/etc/passwd")), "'loss'"),
    "__import__": (graph(node("call_function", "loss", "builtins.__import__", "os")), "'loss'"),
    "getattr on a module": (graph(node("call_function", "loss", "builtins.getattr", {"ref": "logprobs"}, "grad")),
                            "'loss'"),
    "a module": (graph(node("call_module", "loss", "encoder", {"ref": "logprobs"})), "'loss'"),
    "an op not on the list": (graph(node("call_function", "loss", "torch.outer", {"ref": "logprobs"},
                                         {"ref": "logprobs"})), "torch.outer"),
    "an in-place method": (graph(node("call_method", "loss", "add_", {"ref": "logprobs"}, 1.0)), "add_"),
    "a None index": (graph(node("call_function", "loss", "operator.getitem", {"ref": "logprobs"},
                                {"tuple": [None, {"slice": [None, None, None]}]})), "'loss'"),
    "too many nodes": (graph(*(node("call_function", f"n{i}", "torch.exp", {"ref": "logprobs"}) for i in range(300)),
                             result="n0"), "302 nodes"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_graph_off_the_list_is_a_400_naming_its_node(live_server: LiveServer, case: str) -> None:
    key = "tml-" + live_server.new_user()
    headers = {"X-API-Key": key}
    session = httpx.post(f"{live_server.url}/api/v1/create_session", headers=headers, timeout=60,
                         json={"tags": [], "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
    body, named = REFUSED[case]
    answer = httpx.post(f"{live_server.url}/api/v1/create_custom_loss", headers=headers, timeout=60, json={
        "session_id": session, "custom_loss_seq_id": 0, "name": "evil", "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": body, "type": "create_custom_loss"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["category"] == "user" and named in answer.json()["detail"]
