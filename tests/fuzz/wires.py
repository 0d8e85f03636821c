"""Property-based fuzz of the wires that are not GraphQL (issue 34): Tinker's `/api/v1` (JSON, and forward_backward's
protobuf), OpenAI's `/v1`, and the dashboard's forms. Each endpoint has a body strategy whose fields are drawn from
a plausible value (the live server's real ids, in-range numbers) or any JSON value at all, so generated requests
reach the handlers' logic as well as their parsers; a few bodies are not JSON, not objects, or nested 100,000 deep.

A generated request fails only on what a user must never see (`check`): HTTP 5xx, a reset connection, a body not
in its wire's error shape (Tinker `{"detail", "category"}`, OpenAI `{"error": {"message", "type"}}`, the dashboard's
page or htmx toast text), or the runtime restarted. A 4xx is the right answer to bad input.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import strategies as st

from app.tinker.proto import pb

St = st.SearchStrategy

# ---- any JSON value, including what Python's json accepts beyond the standard (NaN, Infinity, 2**80) ----------
SCALARS: St[Any] = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(2**62, 2**80),
                             st.integers(-(2**80), -(2**62)), st.floats(), st.text(max_size=12))
JSON: St[Any] = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                             | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
# Bodies no handler should parse: not JSON, not UTF-8, nested past Python's recursion limit, not an object.
RAW_BODIES: St[bytes] = st.one_of(
    st.sampled_from([b"", b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                     b"null", b"[]", b'"x"', b"NaN", b"1e999"]),
    st.binary(max_size=40))


def either(good: St[Any]) -> St[Any]:
    """A field's value: a plausible one (reaching the logic behind the parse) or any JSON value."""
    return st.one_of(good, good, JSON)


def nested(fields: dict[str, St[Any]]) -> St[Any]:
    """A JSON object whose fields each may be absent, plausible or anything."""
    return st.fixed_dictionaries({}, optional={name: either(good) for name, good in fields.items()})


def body(fields: dict[str, St[Any]]) -> St[Any]:
    """A request's body: mostly `nested(fields)`; now and then one no parser takes, or JSON that is no object."""
    objects = nested(fields)
    return st.one_of(objects, objects, objects, objects, objects, objects, RAW_BODIES, JSON)


def encoded(value: Any) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


# ---- the live server's ids, which the plausible values name ----------------------------------------------------
@dataclass
class Ids:
    session: str
    model: str
    sampler: str
    base: str
    run: str = ""  # a run of the dashboard's visitor (web fuzz)
    checkpoint: int = 0  # one of its checkpoints

    def weights(self) -> St[str]:
        return st.sampled_from([f"tinker://{self.model}/weights/w0", f"tinker://{self.model}/sampler_weights/w0",
                                f"tinker://{self.model}/weights/missing", "tinker://nobody/weights/w0",
                                f"signal://{self.run}/adapter/step-0", "tinker://", "w0"])


def small_ints(low: int = -2, high: int = 8) -> St[int]:
    return st.integers(low, high)


def tinker_prompt() -> St[Any]:
    chunk = st.fixed_dictionaries({"type": st.sampled_from(["encoded_text", "image"]),
                                   "tokens": st.lists(st.integers(-5, 300), max_size=8)})
    return st.fixed_dictionaries({"chunks": st.lists(either(chunk), max_size=3)})


def sampling_params() -> St[Any]:
    return nested({"max_tokens": small_ints(-1, 70), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
                 "top_k": small_ints(-2, 50), "seed": st.integers(-1, 2**64), "stop": st.lists(st.text(max_size=3))})


def tinker_json(ids: Ids) -> dict[str, St[Any]]:
    """POST path → body strategy, for Tinker's JSON endpoints."""
    session, model, sampler = st.sampled_from([ids.session, "nope"]), st.sampled_from([ids.model, "nope:train:0"]), \
        st.sampled_from([ids.sampler, "nope"])
    seq = small_ints(-1, 6)
    return {
        "client/config": body({}),
        "create_session": body({"tags": st.lists(st.text(max_size=5), max_size=3), "display_name": st.text(max_size=20),
                                "user_metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5))}),
        "session_heartbeat": body({"session_id": session}),
        "telemetry": body({"events": st.lists(JSON, max_size=2), "session_id": session}),
        "create_model": body({"session_id": session, "model_seq_id": seq, "base_model": st.just(ids.base),
                              "lora_config": nested({"rank": small_ints(-1, 70), "seed": st.integers(-1, 2**64),
                                                   "train_attn": st.booleans(), "train_mlp": st.booleans(),
                                                   "train_unembed": st.booleans()}),
                              "optimizer_config": nested({"type": st.sampled_from(["adamw", "sgd"])})}),
        "get_info": body({"model_id": model}),
        "load_weights": body({"model_id": model, "seq_id": seq, "path": ids.weights(), "optimizer": st.booleans()}),
        "optim_step": body({"model_id": model, "seq_id": seq, "adam_params": nested(
            {"learning_rate": st.floats(-1, 1), "beta1": st.floats(0, 1), "beta2": st.floats(0, 1),
             "eps": st.floats(0, 1), "weight_decay": st.floats(-1, 1)}),
            "optimizer_params": nested({"type": st.sampled_from(["adamw", "sgd"])})}),
        "save_weights": body({"model_id": model, "seq_id": seq, "path": st.text(max_size=12),
                              "overwrite": st.booleans()}),
        "save_weights_for_sampler": body({"model_id": model, "seq_id": seq, "path": st.none() | st.text(max_size=12),
                                          "sampling_session_seq_id": seq}),
        "create_sampling_session": body({"session_id": session, "sampling_session_seq_id": seq,
                                         "base_model": st.just(ids.base), "model_path": ids.weights()}),
        "asample": body({"sampling_session_id": sampler, "seq_id": seq, "num_samples": small_ints(-1, 20),
                         "prompt": tinker_prompt(), "sampling_params": sampling_params(),
                         "prompt_logprobs": st.booleans()}),
        "retrieve_future": body({"request_id": st.text(max_size=12)}),
        "weights_info": body({"tinker_path": ids.weights()}),
    }


def tinker_gets(ids: Ids) -> dict[str, St[str]]:
    """"METHOD route" → a strategy of paths under /api/v1 (the segments fuzzed, URL-quoted), for the routes whose
    input is their path."""
    segment = st.one_of(st.sampled_from([ids.model, ids.sampler, "weights/w0", "nope"]), st.text(max_size=12))
    quoted = segment.map(lambda text: quote(text, safe=""))
    return {"GET samplers/{id}": quoted.map(lambda s: f"samplers/{s}"),
            "GET training_runs/{id}": quoted.map(lambda s: f"training_runs/{s}"),
            "GET training_runs/{id}/checkpoints": quoted.map(lambda s: f"training_runs/{s}/checkpoints"),
            "DELETE training_runs/{id}/checkpoints/{c}": st.tuples(quoted, quoted).map(
                lambda p: f"training_runs/{p[0]}/checkpoints/{p[1]}"),
            "GET checkpoints": st.just("checkpoints"), "GET training_runs": st.just("training_runs"),
            "GET get_server_capabilities": st.just("get_server_capabilities"),
            # Never the fuzzer's own session (finishing it would end every later case): others' ids, or none.
            "POST sessions/{id}/finish": st.text(max_size=12).map(lambda s: f"sessions/{quote(s, safe='')}/finish")}


def forward_backward(ids: Ids) -> St[bytes]:
    """A ForwardBackwardRequest with fuzzed fields (odd-length byte arrays, unsupported dtypes, image chunks) or
    bytes that are no protobuf at all."""
    tensor = st.fixed_dictionaries({"dense": st.binary(max_size=24), "dtype": st.integers(0, 4)})
    datum = st.fixed_dictionaries({"tokens": st.one_of(st.binary(max_size=24), st.lists(st.integers(-5, 300), max_size=6)
                                                       .map(lambda v: b"".join(x.to_bytes(4, "little", signed=True)
                                                                               for x in v))),
                                   "image": st.booleans(),
                                   "inputs": st.dictionaries(st.sampled_from(["target_tokens", "weights", "advantages",
                                                                              "logprobs", "x"]), tensor, max_size=3)})
    message = st.fixed_dictionaries({"model_id": st.sampled_from([ids.model, "nope:train:0", ""]),
                                     "seq_id": st.integers(-(2**31), 2**31 - 1), "data": st.lists(datum, max_size=3),
                                     "loss_fn": st.sampled_from(["", "cross_entropy", "importance_sampling", "ppo",
                                                                 "nope"]),
                                     "config": st.dictionaries(st.text(max_size=5), st.floats(width=32), max_size=2),
                                     "forward_only": st.booleans()})
    return st.one_of(message.map(_protobuf), message.map(_protobuf), st.binary(max_size=64))


def _protobuf(values: dict[str, Any]) -> bytes:
    message = pb().ForwardBackwardRequest(model_id=values["model_id"], seq_id=values["seq_id"],
                                          loss_fn=values["loss_fn"], forward_only=values["forward_only"])
    message.loss_fn_config.update(values["config"])
    for drawn in values["data"]:
        datum = message.data.add()
        chunk = datum.model_input.add()
        if drawn["image"]:
            chunk.image.SetInParent()
        else:
            chunk.encoded_text.tokens = drawn["tokens"]
        for name, tensor in drawn["inputs"].items():
            datum.loss_fn_inputs[name].dense = tensor["dense"]
            datum.loss_fn_inputs[name].dtype = tensor["dtype"]
    return bytes(message.SerializeToString())


def openai_json(ids: Ids) -> dict[str, St[Any]]:
    model = st.sampled_from([ids.base, ids.run, f"run:{ids.run}", "nope", ""])
    message = nested({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                    "content": st.one_of(st.text(max_size=20), st.lists(nested({"type": st.just("text"),
                                                                              "text": st.text(max_size=8)})))})
    common = {"model": model, "max_tokens": small_ints(-1, 70), "max_completion_tokens": small_ints(-1, 70),
              "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "n": small_ints(-1, 20),
              "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5)),
              "seed": st.integers(-1, 2**64), "stream": st.booleans(), "logprobs": st.one_of(st.booleans(),
                                                                                             small_ints(-1, 25)),
              "top_logprobs": small_ints(-1, 25), "store": st.booleans(), "echo": st.booleans(),
              "stream_options": nested({"include_usage": st.booleans()}), "logit_bias": JSON, "best_of": small_ints(),
              "response_format": nested({"type": st.sampled_from(["text", "json_object"])}), "suffix": st.text(max_size=4),
              "return_token_ids": st.booleans(), "user": st.text(max_size=8)}
    prompt = st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                       st.lists(st.integers(-5, 300), max_size=8), st.lists(st.lists(st.integers(-5, 300), max_size=4),
                                                                            max_size=3))
    return {"completions": body({**common, "prompt": prompt}),
            "chat/completions": body({**common, "messages": st.lists(message, max_size=3)})}


def form(fields: dict[str, St[str]]) -> St[dict[str, str]]:
    """A form's fields, each absent, plausible or any text (forms carry strings only)."""
    return st.fixed_dictionaries({}, optional={name: st.one_of(good, st.text(max_size=30))
                                               for name, good in fields.items()})


def numbers() -> St[str]:
    return st.one_of(st.integers(-3, 100).map(str), st.floats().map(str), st.just("1e999"), st.just(str(2**70)))


# The Hub refusing a push (no network here, a made-up token) is HUB_ERROR, 502 by design (app/errors.py): upstream.
UPSTREAM = {"POST /runs/{id}/push": frozenset({502})}


def dashboard_forms(ids: Ids) -> dict[str, tuple[str, St[dict[str, str]]]]:
    """Route name → (method and path, form strategy), for every dashboard form a signed-in user can post."""
    run = ids.run
    mode = st.sampled_from(["adapter", "merged", "state", "x"])
    return {
        "POST /keys": ("POST /keys", form({"name": st.text(max_size=20)})),
        "POST /start/key": ("POST /start/key", form({"name": st.text(max_size=20)})),
        "POST /runs/new": ("POST /runs/new", form({
            "name": st.text(max_size=20), "baseModel": st.sampled_from([ids.base, "meta-llama/Llama-3.2-1B", "x"]),
            "loraR": numbers(), "loraAlpha": numbers(), "learningRate": numbers(), "trainMlp": st.just("on"),
            "trainUnembed": st.just("on"), "quantization": st.sampled_from(["none", "int8", "nf4", "x"]),
            "gpuConfig": st.text(max_size=8), "tags": st.text(max_size=20), "note": st.text(max_size=20)})),
        "POST /runs/{id}/labels": (f"POST /runs/{run}/labels", form({"name": st.text(max_size=20),
                                                                    "tags": st.text(max_size=20),
                                                                    "note": st.text(max_size=40)})),
        "POST /runs/{id}/archive": (f"POST /runs/{run}/archive", form({"archived": st.sampled_from(["0", "1"])})),
        "POST /runs/{id}/save": (f"POST /runs/{run}/save", form({"name": st.text(max_size=12), "mode": mode})),
        "POST /runs/{id}/push": (f"POST /runs/{run}/push", form({"hub_model_id": st.text(max_size=12),
                                                                "hf_token": st.text(max_size=12), "mode": mode})),
        "POST /playground": ("POST /playground", form(_play(ids))),
        "POST /playground/stream": ("POST /playground/stream", form(_play(ids))),
        "POST /auth/link": ("POST /auth/link", form({"token": st.text(max_size=40)})),
        "POST /admin/users/{id}/disabled": ("POST /admin/users/nobody/disabled",
                                            form({"disabled": st.sampled_from(["0", "1"])})),
        "DELETE /runs/{id}/checkpoints/{n}": (f"DELETE /runs/{run}/checkpoints/99999999999999999999999", form({})),
    }


def _play(ids: Ids) -> dict[str, St[str]]:
    return {"prompt": st.text(max_size=30), "model": st.sampled_from([f"run:{ids.run}", f"base:{ids.base}", "x"]),
            "run_id": st.just(ids.run), "system": st.text(max_size=10), "chat": st.just("on"),
            "stop": st.text(max_size=6), "max_tokens": numbers(), "temperature": numbers(), "top_p": numbers(),
            "num_samples": numbers()}


# ---- what a user must never see ----------------------------------------------------------------------------
@dataclass
class Tally:
    """Cases per endpoint, and what failed (for the report: `pytest -s` prints it at the module's end)."""
    cases: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, set[int]] = field(default_factory=dict)

    def count(self, name: str, status: int) -> None:
        self.cases[name] = self.cases.get(name, 0) + 1
        self.statuses.setdefault(name, set()).add(status)

    def report(self) -> str:
        lines = [f"{name}: {n} cases, statuses {sorted(self.statuses[name])}" for name, n in sorted(self.cases.items())]
        return "\n".join([*lines, f"total: {sum(self.cases.values())} cases"])


def tinker_shape(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    answer = response.json()
    assert isinstance(answer, dict) and isinstance(answer.get("detail"), str) and answer.get("category") == "user", \
        f"not Tinker's user error shape: {response.status_code} {response.text[:300]}"


def openai_shape(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    error = response.json().get("error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error, \
        f"not OpenAI's error shape: {response.status_code} {response.text[:300]}"


def dashboard_shape(response: httpx.Response) -> None:
    """htmx requests: a 4xx is the toast's plain text (or a form partial naming the field), never a JSON or a trace."""
    if response.status_code < 400:
        return
    kind = response.headers.get("content-type", "")
    assert kind.startswith(("text/plain", "text/html")) and response.text.strip(), \
        f"not the dashboard's toast or page: {response.status_code} {kind} {response.text[:300]}"
    assert "Traceback" not in response.text


def check(send: Callable[[], httpx.Response], shape: Callable[[httpx.Response], None], pid: int | None,
          current_pid: Callable[[], int | None], upstream: frozenset[int] = frozenset()) -> httpx.Response:
    """One generated request: no reset connection, no 5xx (but `upstream`'s, a third party's failure in the wire's
    shape), its wire's error shape, the runtime's pid unchanged."""
    try:
        response = send()
    except httpx.TransportError as exc:  # a reset, a closed keep-alive connection, a hang
        raise AssertionError(f"the connection failed: {type(exc).__name__}: {exc}") from None
    assert response.status_code < 500 or response.status_code in upstream, \
        f"HTTP {response.status_code}: {response.text[:400]}"
    shape(response)
    assert current_pid() == pid, f"the runtime restarted: pid {pid} → {current_pid()}"
    return response
