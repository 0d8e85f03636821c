"""Pipelined SDK calls against a real server: numbered calls apply in the order they were made, whatever order
they arrive in; a batch over the server's max_batch_size is split into consecutive calls and answered as one."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardsignal import AsyncSignalClient, FailedPreconditionError, SignalClient
from rewardsignal.results import ForwardBackwardResult, OptimStepResult
from tests.helpers.live_server import LiveServer, error_code, settings_for

SMALL_BATCH = 2  # the small server's max_batch_size
BATCH: list[dict[str, Any]] = [{"text": "one two three four five"}, {"input": "Question: six?", "output": " seven eight"},
         {"text": "nine"}, {"messages": [{"role": "user", "content": "ten"}, {"role": "assistant", "content": "eleven"}]},
         {"text": "twelve thirteen fourteen fifteen sixteen seventeen"}]


@pytest.fixture(scope="module")
def small_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("small"), tiny_model_dir, max_batch_size=SMALL_BATCH))
    yield server
    server.stop()


@pytest.fixture
def small_key(small_server: LiveServer) -> str:
    return small_server.new_user()


class Waits(logging.Handler):
    """The server's ordering log (signal.ordering, this process: the live server runs in a thread): `seen` is set
    when call `seq` on `run_id` is held on the server, waiting for its predecessor."""

    def __init__(self, run_id: str, seq: int, seen: threading.Event, events: list[str]) -> None:
        super().__init__(logging.INFO)
        self.prefix, self.suffix = f"run {run_id}: call {seq} of session ", f" waits for call {seq - 1}"
        self.seen, self.events = seen, events

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix) and message.endswith(self.suffix):
            self.events.append("optim_step held on the server")
            self.seen.set()


class HoldBack(httpx.HTTPTransport):
    """The real connection, except that ForwardBackward's request leaves only once `until` is set."""

    def __init__(self, until: threading.Event, events: list[str]) -> None:
        super().__init__()
        self.until, self.events = until, events
        self.sent: list[tuple[str, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        operation = payload["operationName"]
        if operation == "ForwardBackward":
            assert self.until.wait(120), "the optim_step never reached the server"
            self.events.append("forward_backward sent")
        self.sent.append((operation, payload["variables"]))
        response = super().handle_request(request)
        response.read()
        if operation in ("ForwardBackward", "OptimStep"):
            self.events.append(f"{operation} answered")
        return response


@pytest.fixture
def ordering_log() -> Iterator[logging.Logger]:
    logger = logging.getLogger("signal.ordering")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(level)


def test_an_optim_step_sent_before_its_forward_backward_applies_after_it(
        small_server: LiveServer, small_key: str, ordering_log: logging.Logger) -> None:
    events: list[str] = []
    reached = threading.Event()
    transport = HoldBack(reached, events)
    client = SignalClient(api_key=small_key, base_url=small_server.url, transport=transport)
    run = client.create_run(lora_r=4, seed=7)
    waits = Waits(run.id, 2, reached, events)
    ordering_log.addHandler(waits)
    try:
        batch = BATCH[:SMALL_BATCH]
        backward = run.forward_backward_async(batch=batch)  # held in the transport until the optim_step waits
        step = run.optim_step_async(learning_rate=0.05)
        assert isinstance(backward, Future) and isinstance(step, Future)
        fb, opt = backward.result(timeout=300), step.result(timeout=300)
    finally:
        ordering_log.removeHandler(waits)
    assert events[:2] == ["optim_step held on the server", "forward_backward sent"]
    assert {"ForwardBackward answered", "OptimStep answered"} <= set(events)
    assert [(op, v.get("seq")) for op, v in transport.sent if op != "Limits"][1:] == [("OptimStep", 2), ("ForwardBackward", 1)]
    assert isinstance(fb, ForwardBackwardResult) and isinstance(opt, OptimStepResult)
    assert fb.step == 0 and opt.step == 1  # the step that applied this forward_backward's gradients

    # The same two calls one after the other, on a run made alike: the same gradients, so the same step.
    reference = SignalClient(api_key=small_key, base_url=small_server.url).create_run(lora_r=4, seed=7)
    ref_fb = reference.forward_backward(batch=batch)
    ref_opt = reference.optim_step(learning_rate=0.05)
    assert fb.loss == pytest.approx(ref_fb.loss, abs=1e-6)
    assert opt.grad_norm == pytest.approx(ref_opt.grad_norm, rel=1e-6) and opt.grad_norm > 0
    assert [m.name for m in run.metrics()] == ["loss:mean", "num_tokens", "num_examples", "throughput", "grad_norm",
                                             "learning_rate"]


async def test_async_calls_apply_in_the_order_they_were_made(small_server: LiveServer, small_key: str) -> None:
    async with AsyncSignalClient(api_key=small_key, base_url=small_server.url) as client:
        run = await client.create_run(lora_r=4)
        backward = run.forward_backward(batch=BATCH[:1])  # numbered now: 1
        step = run.optim_step()  # 2
        opt, fb = await asyncio.gather(step, backward)  # the optim_step is sent first; it still applies second
    assert (fb.step, opt.step) == (0, 1) and opt.grad_norm > 0


class Recording(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, dict]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.sent.append((payload["operationName"], payload["variables"]))
        return super().handle_request(request)


def test_a_batch_over_max_batch_size_is_split_and_equals_the_unsplit_one(
        small_server: LiveServer, small_key: str, live_server: LiveServer, key: str) -> None:
    transport = Recording()
    split_client = SignalClient(api_key=small_key, base_url=small_server.url, transport=transport)
    split_run = split_client.create_run(lora_r=4, seed=11)
    split = split_run.forward_backward(batch=BATCH)
    split_step = split_run.optim_step(learning_rate=0.05)

    whole_run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, seed=11)  # max 16: one call
    whole = whole_run.forward_backward(batch=BATCH)
    whole_step = whole_run.optim_step(learning_rate=0.05)

    parts = [v for op, v in transport.sent if op == "ForwardBackward"]
    assert [len(v["batch"]) for v in parts] == [2, 2, 1]
    assert [v["seq"] for v in parts] == [1, 2, 3] and len({v["session"] for v in parts}) == 1
    # A blocking call made once the parts were answered: nothing in flight to come after, so no number.
    (step_variables,) = [v for op, v in transport.sent if op == "OptimStep"]
    assert "seq" not in step_variables and "session" not in step_variables
    assert split.loss == pytest.approx(whole.loss, abs=1e-6)
    assert (split.num_tokens, split.num_examples, split.step) == (whole.num_tokens, whole.num_examples, 0)
    assert split.num_examples == len(BATCH)
    # `mean` normalises over every call before the optim_step: the split batch's step is the whole one's.
    assert split_step.grad_norm == pytest.approx(whole_step.grad_norm, rel=1e-5)


def test_blocking_calls_carry_no_number_and_each_pipeline_starts_at_one(small_server: LiveServer,
                                                                        small_key: str) -> None:
    """So a server of several worker processes, each seeing some of the calls, never waits for a number it cannot
    see: blocking calls go unnumbered, and a pipeline made with nothing in flight starts a session of its own."""
    transport = Recording()
    run = SignalClient(api_key=small_key, base_url=small_server.url, transport=transport).create_run(lora_r=4)
    run.forward_backward(batch=BATCH[:1])
    run.optim_step()
    assert run.sample_async(prompts=["a"], max_tokens=2).result(timeout=300).outputs[0][0] is not None
    assert run.forward_backward_async(batch=BATCH[:1]).result(timeout=300).step == 1
    sent = [(op, v.get("seq"), v.get("session")) for op, v in transport.sent if op not in ("CreateRun", "Limits")]
    assert [(op, seq) for op, seq, _ in sent] == [("ForwardBackward", None), ("OptimStep", None), ("Sample", 1),
                                                  ("ForwardBackward", 1)]
    assert sent[2][2] != sent[3][2]  # the sample was answered first: a new pipeline


def _numbered(server: LiveServer, key: str, run_id: str, seq: int | None, session: str | None) -> dict:
    return server.graphql("mutation($r: ID!, $seq: Int, $s: String) { forwardBackward(runId: $r, "
                          "batch: [{text: \"a numbered call\"}], seq: $seq, session: $s) { step } }",
                          {"r": run_id, "seq": seq, "s": session}, key=key)


def test_a_gap_in_a_sessions_numbers_is_refused_naming_seq(small_server: LiveServer, small_key: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(small_server.app.state.services.runs.order, "wait_seconds", 0.5)
    run = SignalClient(api_key=small_key, base_url=small_server.url).create_run(lora_r=4)
    assert "errors" not in _numbered(small_server, small_key, run.id, 1, "gappy")
    assert "errors" not in _numbered(small_server, small_key, run.id, 1, "gappy")  # a retry's number: at once
    body = _numbered(small_server, small_key, run.id, 3, "gappy")  # 2 never comes
    assert error_code(body) == "FAILED_PRECONDITION"
    assert body["errors"][0]["extensions"]["field"] == "seq" and "call 2" in body["errors"][0]["message"]
    # A session this server has never seen (it restarted, say) goes on as its start after the wait.
    assert "errors" not in _numbered(small_server, small_key, run.id, 5, "from-before-a-restart")


@pytest.mark.parametrize(("seq", "session", "field"), [(1, None, "session"), (None, "s", "seq"), (0, "s", "seq"),
                                                       (1, "", "session"), (1, "x" * 65, "session")])
def test_a_number_needs_both_arguments(small_server: LiveServer, small_key: str, seq: int | None,
                                       session: str | None, field: str) -> None:
    run = SignalClient(api_key=small_key, base_url=small_server.url).create_run(lora_r=4)
    body = _numbered(small_server, small_key, run.id, seq, session)
    assert error_code(body) == "BAD_INPUT" and body["errors"][0]["extensions"]["field"] == field


def test_the_limits_query_answers_the_servers_max_batch_size(small_server: LiveServer, small_key: str) -> None:
    assert small_server.graphql("{ limits { maxBatchSize } }", key=small_key)["data"] == {"limits": {"maxBatchSize": 2}}


def test_results_pass_through_futures_errors(small_server: LiveServer, small_key: str, tmp_path: Path) -> None:
    run = SignalClient(api_key=small_key, base_url=small_server.url).create_run(lora_r=4)
    with pytest.raises(FailedPreconditionError):
        run.optim_step_async().result(timeout=300)  # no gradients yet: the future raises the typed error
