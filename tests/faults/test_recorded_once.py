"""Applied means recorded, once (issue 19 §5): every call the runtime applied is recorded in one transaction keyed by
(run_id, request_id): its call_records row, metric rows, runs.step, samples and compute seconds.

The repro: the failpoint after_journal kills the runtime after it journals a call and before it answers. The SDK's
retry (same request id) gets the replayed answer, and the server now records it: the step advances, the metric rows
and compute seconds are there, in exactly one call record; a second replay records nothing more. A database that
cannot take the recording answers UNAVAILABLE, and the retry records the call once."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import func, select

from app.db import Database
from app.tables import CallRecord, Metric, Run, Sample
from rewardsignal import SignalClient
from tests.conftest import ON_POSTGRES
from tests.helpers.live_server import LiveServer, error_code, settings_for

BATCH = [{"text": "a sentence that the run keeps training on"}]
FAULT = {"SIGNAL_RUNTIME_FAULTS": "after_journal"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Short lock waits and recording retries, so the locked recording answers within a few seconds.
    live = LiveServer.start(settings_for(tmp_path_factory.mktemp("recorded-once"), tiny_model_dir,
                                         db_lock_timeout_s=0.3, record_retry_s=1.0))
    yield live
    live.stop()


@dataclass
class Recorded:
    """What the database holds for one run, read directly (the usage view and GraphQL show parts of it)."""

    step: int
    compute_seconds: float
    metrics: dict[str, int]  # name → rows
    samples: int
    records: list[SimpleNamespace]  # call_records rows, as values (compared by value)

    def of(self, request_id: str) -> list[SimpleNamespace]:
        return [row for row in self.records if row.request_id == request_id]


def recorded(server: LiveServer, run_id: str) -> Recorded:
    async def read() -> Recorded:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                run = await session.get(Run, run_id)
                assert run is not None
                counts = await session.execute(select(Metric.name, func.count()).where(Metric.run_id == run_id)
                                               .group_by(Metric.name))
                metrics = {str(name): int(count) for name, count in counts}
                samples = await session.scalar(select(func.count()).select_from(Sample).where(Sample.run_id == run_id))
                rows = await session.scalars(select(CallRecord).where(CallRecord.run_id == run_id)
                                             .order_by(CallRecord.created_at))
                records = [SimpleNamespace(**{column.key: getattr(row, column.key)
                                              for column in CallRecord.__table__.columns}) for row in rows]
                return Recorded(run.step, run.compute_seconds, metrics, int(samples or 0), records)
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever the test runs in
        return pool.submit(asyncio.run, read()).result()


class DisarmOnWorkerFailed(httpx.HTTPTransport):
    """The network boundary: forwards every request, keeps each attempt at `operation`, and runs `disarm` when the
    server answers WORKER_FAILED, before the SDK retries (so the retry reaches a runtime without the failpoint)."""

    def __init__(self, operation: str, disarm: Callable[[], None]) -> None:
        super().__init__()
        self.operation, self.disarm = operation, disarm
        self.sent: list[dict[str, Any]] = []  # the whole body of each attempt
        self.codes: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        payload = json.loads(request.content)
        if payload.get("operationName") == self.operation:
            response.read()
            self.sent.append(payload)
            self.codes.append(error_code(response.json()))
            if self.codes[-1] == "WORKER_FAILED":
                self.disarm()
        return response


def arm_after_journal(server: LiveServer) -> None:
    """The next runtime dies after journaling a call, before answering it: kill this one, respawn with the failpoint."""
    client = server.backend.client
    client.env = dict(FAULT)
    client.kill()
    server.wait_for(lambda: not client.alive, "the runtime to be gone")


def post(server: LiveServer, key: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/graphql", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    return dict(response.json())


# operation → (the SDK's operation name, what gives the killed call its gradients, the call, metric names it writes)
CASES: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any], tuple[str, ...]]] = {
    "optim_step": ("OptimStep", lambda run: run.forward_backward(batch=BATCH), lambda run: run.optim_step(),
                   ("grad_norm", "learning_rate")),
    "forward_backward": ("ForwardBackward", lambda run: None, lambda run: run.forward_backward(batch=BATCH),
                         ("loss:mean", "num_tokens", "num_examples", "throughput")),
}


@pytest.mark.parametrize("operation", list(CASES))
def test_a_call_killed_after_its_journal_is_recorded_once_by_its_retry(server: LiveServer, operation: str) -> None:
    name, prepare, call, metrics = CASES[operation]
    key = server.new_user()
    runtime = server.backend.client
    transport = DisarmOnWorkerFailed(name, lambda: setattr(runtime, "env", {}))
    run = SignalClient(api_key=key, base_url=server.url, transport=transport, retry_backoff=0.01).create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    prepare(run)
    before = recorded(server, run.id)
    assert before.step == 1

    transport.sent.clear()  # the set-up's calls
    transport.codes.clear()
    arm_after_journal(server)
    answer = call(run)

    assert transport.codes == ["WORKER_FAILED", None]  # killed after its journal; the retry was answered
    first, retry = transport.sent
    request_id = first["variables"]["requestId"]
    assert retry["variables"]["requestId"] == request_id and uuid.UUID(request_id)
    after = recorded(server, run.id)
    (record,) = after.of(request_id)  # exactly one call record
    assert record.operation == operation and record.user_id == before.records[0].user_id
    assert (record.gpu_type, record.gpu_count) == ("cpu", 0)
    assert record.compute_seconds > 0
    assert after.compute_seconds == pytest.approx(before.compute_seconds + record.compute_seconds)
    assert after.compute_seconds == pytest.approx(sum(row.compute_seconds for row in after.records))
    assert all(after.metrics.get(metric, 0) == before.metrics.get(metric, 0) + 1 for metric in metrics)
    if operation == "optim_step":
        assert answer.step == 2 and after.step == 2  # runs.step advanced past the killed step
    else:
        assert record.tokens_in == answer.num_tokens > 0 and record.tokens_out == 0
        assert after.step == 1

    # A second replay of the same call records nothing more.
    again = post(server, key, retry)
    assert "errors" not in again, again
    assert recorded(server, run.id) == after


def test_a_call_without_a_request_id_gets_one_and_its_record(server: LiveServer) -> None:
    key = server.new_user()
    run = SignalClient(api_key=key, base_url=server.url).create_run(lora_r=4)
    body = post(server, key, {"query": "mutation($id: ID!, $batch: [BatchItem!]!) { forwardBackward(runId: $id, "
                                       "batch: $batch) { numTokens } }", "variables": {"id": run.id, "batch": BATCH}})
    assert "errors" not in body, body
    (record,) = recorded(server, run.id).records
    assert uuid.UUID(record.request_id) and record.operation == "forward_backward"
    assert record.tokens_in == body["data"]["forwardBackward"]["numTokens"]


SAMPLE = {"query": """mutation($id: ID!, $rid: String) {
    sample(runId: $id, prompts: ["hello", "world"], maxTokens: 48, numSamples: 2, seed: 3, requestId: $rid) {
      outputs } }"""}


@contextmanager
def recording_locked(server: LiveServer) -> Iterator[None]:
    """While held, the server cannot record a call: SQLite's whole file under an exclusive lock, or PostgreSQL's
    call_records table under an ACCESS EXCLUSIVE lock (the server's lock_timeout then answers 55P03)."""
    url = server.settings.resolved_database_url
    if not ON_POSTGRES:
        holder = sqlite3.connect(Path(url.split("///", 1)[1]), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    locked, release = threading.Event(), threading.Event()

    async def hold() -> None:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            async with connection.transaction():
                await connection.execute("LOCK TABLE call_records IN ACCESS EXCLUSIVE MODE")
                locked.set()
                await asyncio.to_thread(release.wait)
        finally:
            await connection.close()

    holder_thread = threading.Thread(target=asyncio.run, args=(hold(),))
    holder_thread.start()
    assert locked.wait(60), "the lock was not taken"
    try:
        yield
    finally:
        release.set()
        holder_thread.join(60)


def test_a_recording_the_database_cannot_take_answers_unavailable_and_the_retry_records_it(
        server: LiveServer) -> None:
    key = server.new_user()
    run = SignalClient(api_key=key, base_url=server.url).create_run(lora_r=4)
    body = {**SAMPLE, "variables": {"id": run.id, "rid": str(uuid.uuid4())}}
    answer: dict[str, dict[str, Any]] = {}
    thread = threading.Thread(target=lambda: answer.setdefault("first", post(server, key, body)))
    if ON_POSTGRES:  # only call_records is locked, which nothing reads before the recording
        with recording_locked(server):
            thread.start()
            thread.join(timeout=300)
    else:  # the whole file is locked: only once the sample is in the runtime (its ticket taken)
        thread.start()
        server.wait_for(lambda: server.backend.in_flight > 0, "the sample to reach the runtime")
        with recording_locked(server):
            thread.join(timeout=300)
    first = answer["first"]
    assert error_code(first) == "UNAVAILABLE", first
    assert first["errors"][0]["extensions"]["retryable"] is True
    assert "applied but not recorded" in first["errors"][0]["message"]
    nothing = recorded(server, run.id)
    assert (nothing.samples, nothing.records, nothing.compute_seconds) == (0, [], 0.0)

    retried = post(server, key, body)  # the runtime remembers the sample: the same answer, recorded now
    assert "errors" not in retried, retried
    done = recorded(server, run.id)
    (record,) = done.records
    assert done.samples == 4 and record.operation == "sample"  # 2 prompts x 2 samples
    assert record.tokens_out > 0 and record.tokens_in > 0
    assert done.compute_seconds == pytest.approx(record.compute_seconds) and record.compute_seconds > 0
    assert post(server, key, body) == retried and recorded(server, run.id) == done  # once
