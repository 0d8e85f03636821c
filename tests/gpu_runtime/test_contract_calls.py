"""The typed contract: requests round-trip as data, unknown and missing arguments are refused by name, the
runtime refuses text it cannot encode, and a server refuses a runtime that speaks another contract version."""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
import typing
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.contract import (
    CALLS,
    CONTRACT_VERSION,
    MAX_RUN_SEED,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    ForwardBackward,
    Method,
    Result,
    RuntimeOptions,
    Sample,
    parse_call,
)
from gpu_runtime.errors import BadInput, FailedPrecondition

EXAMPLES: dict[Method, dict[str, Any]] = {
    Method.CREATE_RUN: {"run_id": "r1", "user_id": "u1", "base_model": "m", "lora": {"r": 4}, "seed": 3},
    Method.FORWARD_BACKWARD: {"run_id": "r1", "batch": [{"text": "hi"}], "request_id": "a"},
    Method.FORWARD: {"base_model": "m", "user_id": "u1", "batch": [{"text": "hi"}], "loss_fn": "cross_entropy"},
    Method.RENDER_DATUMS: {"run_id": "r1", "batch": [{"text": "hi"}]},
    Method.OPTIM_STEP: {"run_id": "r1", "adam": {"learning_rate": 0.01}},
    Method.SAMPLE: {"run_id": "r1", "prompts": ["hi"], "max_tokens": 3, "stop": ["x"]},
    Method.SAVE_STATE: {"run_id": "r1", "mode": "state"},
    Method.SAVE_WEIGHTS_FOR_SAMPLER: {"run_id": "r1", "name": "final", "request_id": "q1"},
    Method.LOAD_RUN: {"run_id": "r1"},
    Method.RUN_INFO: {"run_id": "r1"},
    Method.CLOSE_RUN: {"run_id": "r1"},
    Method.DELETE_RUN: {"run_id": "r1"},
    Method.EXPORT_CHECKPOINT: {"run_id": "r1", "mode": "adapter", "step": 2},
    Method.LOAD_STATE: {"run_id": "r1", "checkpoint": "signal://r0/state/final", "with_optimizer": False,
                        "request_id": "b"},
    Method.DELETE_CHECKPOINT: {"run_id": "r1", "mode": "sampler", "name": "final"},
    Method.PING: {},
    Method.RUNTIME_STATE: {},
    Method.TOKENIZER: {"base_model": "m"},
    Method.RENDER_CHAT: {"run_id": "r1", "messages": [{"role": "user", "content": "hi"}], "decode": [1, 2]},
    Method.CANCEL: {"request_id": "v1-abc", "user_id": "u1"},
}


def test_every_method_has_a_request_type_and_an_example() -> None:
    assert set(CALLS) == set(Method) == set(EXAMPLES)


@pytest.mark.parametrize("method", list(Method))
def test_each_request_names_the_answer_its_type_promises(method: Method) -> None:
    # `answer` parses what the runtime sends; the type parameter is what the server's code reads (Call[A] -> A).
    kind = CALLS[method]
    promised = [typing.get_args(base)[0] for base in kind.__dict__.get("__orig_bases__", ()) if typing.get_args(base)]
    assert promised == [kind.answer] and issubclass(kind.answer, Result)


@pytest.mark.parametrize("method", list(Method))
def test_a_request_crosses_as_data_and_comes_back_equal(method: Method) -> None:
    call = parse_call(method.value, EXAMPLES[method])
    wire = json.loads(json.dumps(call.to_dict()))  # what the socket and Modal's .remote() carry
    assert parse_call(method.value, wire) == call
    assert {k: v for k, v in wire.items() if k in EXAMPLES[method]} == EXAMPLES[method]


@pytest.mark.parametrize(("method", "params", "field"), [
    ("nope", {}, "method"),
    ("optim_step", {"run_id": "r1", "adma": {}}, "params"),
    ("forward_backward", {"run_id": "r1"}, "params"),  # no batch
    ("forward_backward", {"run_id": "../etc", "batch": [{"text": "a"}]}, "run_id"),
    ("forward_backward", {"run_id": "r1", "batch": []}, "batch"),
    ("forward_backward", {"run_id": "r1", "batch": [{"text": "a"}], "request_id": "x" * 129}, "request_id"),
    ("forward_backward", {"run_id": "r1", "batch": [{"text": "a"}], "request_id": "tab\there"}, "request_id"),
    ("sample", {"run_id": "r1", "prompts": ["ok", "a\ud800"]}, "prompts[1]"),
    ("sample", {"run_id": "r1", "prompt_tokens": [[1], [2, "3"]]}, "prompt_tokens[1]"),
    ("sample", {"run_id": "r1", "prompts": ["ok"], "stop": [1, "x"]}, "stop"),
    ("tokenizer", {}, "base_model"),
    ("tokenizer", {"base_model": "m", "run_id": "r1"}, "base_model"),
    ("tokenizer", {"run_id": "../r1"}, "run_id"),
    ("forward_backward", {"run_id": "r1", "batch": [{"input": "ok", "output": "b\udfff"}]}, "batch[0].output"),
    ("forward_backward", {"run_id": "r1", "batch": [{"messages": [{"role": "user", "content": "\ud800"}]}]},
     "batch[0].messages[0].content"),
    ("optim_step", {"run_id": "r1", "adam": {"beta1": 1.0}}, "adam.beta1"),
    ("save_state", {"run_id": "r1", "mode": "everything"}, "mode"),
    ("save_weights_for_sampler", {"run_id": "r1", "name": "../up"}, "name"),
    ("save_weights_for_sampler", {"run_id": "r1", "name": "a@b"}, "name"),
    ("sample", {"prompts": ["hi"]}, "base_model"),
    ("sample", {"prompts": ["hi"], "base_model": "m"}, "user_id"),
    ("sample", {"prompts": ["hi"], "snapshot": "s", "base_model": "m", "user_id": "u1"}, "snapshot"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "base_model": "m"}, "base_model"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "snapshot": "s", "checkpoint": "c"}, "checkpoint"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "snapshot": "a/b"}, "snapshot"),
    ("export_checkpoint", {"run_id": "r1", "mode": "sampler", "step": 0}, "name"),
    ("save_state", {"run_id": "r1", "name": "../up"}, "name"),
    ("save_state", {"run_id": "r1", "mode": "merged", "with_optimizer": True}, "with_optimizer"),
    ("load_state", {"run_id": "r1", "checkpoint": "signal://r0/weights"}, "checkpoint"),
    ("load_state", {"run_id": "r1", "checkpoint": "signal://r0/merged/final"}, "checkpoint"),
    ("load_state", {"run_id": "r1", "checkpoint": "signal://../state/final"}, "checkpoint"),
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "from_checkpoint": "final"},
     "from_checkpoint"),
    ("delete_checkpoint", {"run_id": "r1", "mode": "weights", "name": "final"}, "mode"),
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "seed": -1}, "seed"),
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "lora": {"r": 0}}, "lora.r"),
    # number bounds (docs/ERRORS.md#bounds)
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "lora": {"r": 4, "alpha": 1e308}}, "lora.alpha"),
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "lora": {"r": 4, "alpha": 65}}, "lora.alpha"),
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "seed": MAX_RUN_SEED + 1}, "seed"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "temperature": MAX_TEMPERATURE + 0.01}, "temperature"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "temperature": -0.1}, "temperature"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "top_k": MAX_TOP_K + 1}, "top_k"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "top_k": -2}, "top_k"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "stop": ["x"] * (MAX_STOP + 1)}, "stop"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "stop": list(range(MAX_STOP + 1))}, "stop"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "seed": MAX_SEED + 1}, "seed"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "seed": -1}, "seed"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "stream": "yes"}, "stream"),
    ("cancel", {"request_id": "v1-abc", "user_id": "../u"}, "user_id"),
    ("cancel", {"request_id": "", "user_id": "u1"}, "request_id"),
    ("optim_step", {"run_id": "r1", "adam": {"grad_clip_norm": 1e308}}, "adam.grad_clip_norm"),
])
def test_bad_requests_are_refused_naming_the_field(method: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(BadInput) as caught:
        parse_call(method, params)
    assert caught.value.field == field


@pytest.mark.parametrize(("method", "params"), [
    ("create_run", {"run_id": "r1", "user_id": "u1", "base_model": "m", "lora": {"r": 4, "alpha": 64},
                    "seed": MAX_RUN_SEED}),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "temperature": MAX_TEMPERATURE, "top_k": MAX_TOP_K,
                "stop": ["x" * MAX_STOP_CHARS] * MAX_STOP, "seed": MAX_SEED}),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "top_k": -1, "stop": list(range(MAX_STOP))}),
    ("optim_step", {"run_id": "r1", "adam": {"grad_clip_norm": 1000.0}}),
])
def test_numbers_at_their_bounds_are_taken(method: str, params: dict[str, Any]) -> None:
    parse_call(method, params)


SMALL = RuntimeOptions(max_batch_size=4, max_batch_tokens=32, max_sample_rows=8, max_sample_prompt_tokens=20,
                       max_sample_tokens=64)


@pytest.mark.parametrize(("method", "params", "field"), [
    ("sample", {"run_id": "r1", "prompts": ["hi"] * 9, "max_tokens": 1}, "prompts"),
    ("sample", {"run_id": "r1", "prompts": ["hi"] * 3, "num_samples": 3, "max_tokens": 1}, "num_samples"),
    ("sample", {"run_id": "r1", "prompts": ["hi"], "num_samples": 8, "max_tokens": 9}, "max_tokens"),
    ("sample", {"run_id": "r1", "prompt_tokens": [[1] * 11], "num_samples": 2, "max_tokens": 1}, "prompt_tokens"),
    ("sample", {"prompts": ["hi"], "base_model": "m", "user_id": "u1", "max_tokens": 65}, "max_tokens"),
    ("forward_backward", {"run_id": "r1", "batch": [{"text": "a"}] * 5}, "batch"),
    ("forward_backward", {"run_id": "r1", "batch": [{"tokens": list(range(33))}]}, "batch"),
    ("forward_backward", {"run_id": "r1", "batch": [{"model_input": list(range(20)),
                                                "loss_fn_inputs": {"target_tokens": list(range(20))}}] * 2},
     "batch"),
    ("forward", {"base_model": "m", "user_id": "u1", "batch": [{"tokens": list(range(33))}]}, "batch"),
    ("render_datums", {"run_id": "r1", "batch": [{"text": "a"}] * 5}, "batch"),
])
def test_over_bound_calls_are_refused_naming_the_field(method: str, params: dict[str, Any], field: str) -> None:
    call = parse_call(method, params)  # well-formed: only its size is refused
    with pytest.raises(BadInput) as caught:
        call.check_size(SMALL)
    assert caught.value.field == field


@pytest.mark.parametrize(("method", "params"), [
    ("sample", {"run_id": "r1", "prompts": ["hi"] * 8, "max_tokens": 8}),  # 8 rows, 64 tokens: both at the bound
    ("sample", {"run_id": "r1", "prompt_tokens": [[1] * 10], "num_samples": 2, "max_tokens": 1}),
    ("forward_backward", {"run_id": "r1", "batch": [{"tokens": list(range(16))}] * 2}),
])
def test_calls_at_the_size_bounds_are_taken(method: str, params: dict[str, Any]) -> None:
    parse_call(method, params).check_size(SMALL)


def test_the_sampling_repros_are_refused_by_the_default_bounds() -> None:
    """Issue 19's two unbounded calls: 5,000 prompts x 1 token, and 1 prompt x 16 samples x 4,096 tokens."""
    wide = parse_call("sample", {"run_id": "r1", "prompts": ["a"] * 5000, "max_tokens": 1})
    long = parse_call("sample", {"run_id": "r1", "prompts": ["a"], "num_samples": 16, "max_tokens": 4096})
    with pytest.raises(BadInput, match="sequences") as rows:
        wide.check_size(RuntimeOptions())
    with pytest.raises(BadInput, match="generates at most") as tokens:
        long.check_size(RuntimeOptions())
    assert (rows.value.field, tokens.value.field) == ("prompts", "max_tokens")


def test_packed_tokens_count_toward_the_batch_bound() -> None:
    ids = base64.b64encode(struct.pack("<33i", *range(33))).decode()
    call = parse_call("forward_backward", {"run_id": "r1", "batch": [{"packed": {"model_input": ids}}]})
    with pytest.raises(BadInput) as caught:
        call.check_size(SMALL)
    assert caught.value.field == "batch" and "33 tokens" in caught.value.message


def test_defaults_are_the_contracts() -> None:
    call = parse_call("sample", {"run_id": "r1", "prompts": ["hi"]})
    assert isinstance(call, Sample)
    assert (call.max_tokens, call.temperature, call.top_p, call.top_k, call.num_samples) == (64, 1.0, 1.0, 0, 1)
    fb = parse_call("forward_backward", {"run_id": "r1", "batch": [{"text": "a"}]})
    assert isinstance(fb, ForwardBackward) and fb.loss_fn == "cross_entropy"


def _old_runtime(path: Path, greeting: dict[str, Any]) -> threading.Thread:
    """What a runtime from an older checkout sends on its socket: its greeting line, then it waits."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        connection, _ = listener.accept()
        connection.sendall(json.dumps(greeting).encode() + b"\n")
        connection.recv(1)  # until the client hangs up
        connection.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("greeting", [
    {"ready": True, "pid": 4242},  # before the typed contract: no version at all
    {"ready": True, "pid": 4242, "contract": CONTRACT_VERSION + 1},
])
def test_a_server_refuses_a_runtime_of_another_contract_version_naming_the_fix(
        tmp_path: Path, greeting: dict[str, Any]) -> None:
    served = _old_runtime(tmp_path / "runtime.sock", greeting)
    client = RuntimeClient(str(tmp_path), device="cpu", start_timeout=30, shared=True)
    with pytest.raises(FailedPrecondition) as caught:
        client.start()
    assert f"this server {CONTRACT_VERSION}" in caught.value.message
    assert "kill 4242" in caught.value.message and caught.value.field == "runtime"
    served.join(timeout=10)
    assert not served.is_alive()
