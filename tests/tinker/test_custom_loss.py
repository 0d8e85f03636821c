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


def scaled_mix(logprobs: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor, advantages: torch.Tensor) -> Any:
    """A scalar per datum (rank 0) and K values per position (rank 2, a soft target's weights) beside a [T] input."""
    weight = mix.sum(-1) * scale + advantages
    loss = -(logprobs * weight).sum() + (mix * mix).mean() * scale
    return loss, {"custom/scale:mean": scale.detach(), "custom/mix_max:sum": mix.amax(), "custom/w:mean": weight.mean()}


def scalar_only(logprobs: torch.Tensor, scale: torch.Tensor) -> Any:
    return -(logprobs.sum() * scale), {"custom/scale:sum": scale}


def shaped_data(names: tuple[str, ...]) -> list[Any]:
    """data() with a per-datum scalar `scale` (shape [], as TensorData.from_torch of a 0-d tensor) and (N, 3) `mix`."""
    from tinker import types

    out = []
    for j, d in enumerate(data()):
        n = len(d.model_input.to_ints())
        extra = {"scale": types.TensorData(data=[0.5 + j], dtype="float32", shape=[]),
                 "mix": types.TensorData(data=[0.1 * ((i + j) % 7) for i in range(3 * n)], dtype="float32", shape=[n, 3])}
        inputs = {k: v for k, v in d.loss_fn_inputs.items() if k in ("target_tokens", *names)}
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs={**inputs, **{k: extra[k] for k in names
                                                                                         if k in extra}}))
    return out


CASES = {  # loss, its inputs' ranks, the datums, the metrics to compare
    "rank-1 inputs": (ppo_clip, RANKS, data, ("custom/ratio:mean", "custom/clipped:sum")),
    "a scalar and [T, K] inputs": (scaled_mix, {"logprobs": 1, "scale": 0, "mix": 2, "advantages": 1},
                                   lambda: shaped_data(("scale", "mix", "advantages")),
                                   ("custom/scale:mean", "custom/mix_max:sum", "custom/w:mean")),
    "a scalar alone": (scalar_only, {"logprobs": 1, "scale": 0}, lambda: shaped_data(("scale",)),
                       ("custom/scale:sum",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_server_side_loss_equals_the_same_loss_run_client_side(service_client: Any, case: str) -> None:
    from tinker import types

    fn, ranks, make, keys = CASES[case]
    handle = service_client.create_custom_loss(fn, ranks).result()
    assert handle.loss_id is not None  # uploaded: client/config says custom_loss_server_side
    local = dataclasses.replace(handle, loss_id=None)  # the same traced loss, run by the SDK itself
    server_side = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=11).result()
    client_side = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=11).result()
    results, norms = [], []
    for training, loss in ((server_side, handle), (client_side, local)):
        results.append(training.forward_backward_custom(make(), loss).result())
        step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        norms.append(step.metrics["optim/grad_norm"])
    served, reference = results
    for key in ("loss:sum", *keys):
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


def scalar_mean(logprobs: torch.Tensor, scale: torch.Tensor) -> Any:
    return -(logprobs.mean() * scale), {}  # a session uploads each traced loss once: not scalar_only's graph


def test_an_input_of_another_rank_than_declared_is_a_400_naming_it(service_client: Any) -> None:
    """forward_backward with loss_fn "custom" skips the SDK's own rank check: Signal makes it, naming the input."""
    from tinker import types

    handle = service_client.create_custom_loss(scalar_mean, {"logprobs": 1, "scale": 0}).result()
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8).result()
    (d,) = data()[:1]
    n = len(d.model_input.to_ints())
    wrong = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "scale": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})
    with pytest.raises(Exception, match=r"loss_fn_inputs\.scale has rank 1, but custom loss 'scalar_mean' declares"):
        training.forward_backward([wrong], "custom", {"loss_id": handle.loss_id}).result()


def grows(logprobs: torch.Tensor) -> Any:
    wide = torch.cat([logprobs] * 64)  # 64 x its input: at the bound
    return torch.cat([wide] * 64).sum(), {}  # 4096 x: past it


def test_a_node_that_grows_past_its_bound_is_a_400_naming_it(service_client: Any) -> None:
    handle = service_client.create_custom_loss(grows, {"logprobs": 1}).result()
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8).result()
    from tinker import types

    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data()[:1]]
    with pytest.raises(Exception, match=r"node 'cat_1' \(torch.cat\) makes a tensor of \d+ elements"):
        training.forward_backward_custom(plain, handle).result()


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
