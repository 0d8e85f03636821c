"""Calls on one run keep arrival order; calls on different runs do not disturb each other;
the event loop stays free while the worker trains."""

from __future__ import annotations

import logging
import threading

import httpx

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer

BATCHES = [[{"text": f"example number {i} says hello to the model"}] for i in range(3)]


def train(client: SignalClient, run_id: str) -> list[float]:
    run = client.get_run(run_id)
    losses = []
    for batch in BATCHES:
        losses.append(run.forward_backward(batch=batch).loss)
        run.optim_step(learning_rate=0.02)
    return losses


def test_interleaved_runs_train_as_if_alone(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    alone = client.create_run(lora_r=4, seed=7)
    expected = train(client, alone.id)

    twins = [client.create_run(lora_r=4, seed=7) for _ in range(2)]
    results: dict[str, list[float]] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.id, train(client, r.id))) for r in twins]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for twin in twins:
        assert results[twin.id] == expected
        assert client.get_run(twin.id).step == len(BATCHES)


def test_concurrent_calls_on_one_run_are_each_applied_once(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    # Many gradient accumulations racing on one run: each is applied once, none is lost.
    threads = [threading.Thread(target=run.forward_backward, kwargs={"batch": BATCHES[0]}) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert run.optim_step().step == 1
    losses = [m.value for m in run.metrics(name="loss:mean")]
    assert len(losses) == 6 and max(losses) - min(losses) < 1e-6  # same weights each time: no step in between


def test_healthz_answers_while_a_run_trains(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    busy = threading.Thread(target=run.sample, kwargs={"prompts": ["hello"] * 4, "max_tokens": 120,
                                                       "temperature": 1.0, "num_samples": 2})
    busy.start()
    answers: list[tuple[int, bool]] = []
    while busy.is_alive() and len(answers) < 50:
        response = httpx.get(f"{live_server.url}/healthz", timeout=10)
        answers.append((response.status_code, busy.is_alive()))
    busy.join(timeout=300)
    # At least one health check was answered while the sample was still running in the worker.
    assert any(status == 200 and running for status, running in answers)


def test_a_flooding_user_does_not_hold_back_another_users_call(live_server: LiveServer, key: str) -> None:
    flooder = SignalClient(api_key=key, base_url=live_server.url)
    bystander = SignalClient(api_key=live_server.new_user(), base_url=live_server.url)
    runs = [flooder.create_run(lora_r=4) for _ in range(4)]
    single_run = bystander.create_run(lora_r=4)
    batch = BATCHES[0] * 4
    order: list[str] = []
    lock = threading.Lock()
    # How many calls had finished when the single call reached the runtime: the backend's log line says when.
    # (The path to the runtime — HTTP, key, ticket — is not the scheduler's to make fair, so it is not counted.)
    finished_before_arrival: list[int] = []

    class Arrival(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.args and single_run.id in record.args:
                with lock:
                    finished_before_arrival.append(len(order))

    backend_log = logging.getLogger("signal.backend")
    handler, level = Arrival(logging.DEBUG), backend_log.level
    backend_log.addHandler(handler)
    backend_log.setLevel(logging.DEBUG)

    def call(name: str, run) -> None:  # type: ignore[no-untyped-def]
        run.forward_backward(batch=batch)
        with lock:
            order.append(name)

    try:
        flood = [threading.Thread(target=call, args=(f"flood-{i}", runs[i % 4])) for i in range(20)]
        for thread in flood:
            thread.start()
        # The flood is inside the backend: a run's calls pipeline to the runtime, whose scheduler picks each run's head.
        live_server.wait_for(lambda: live_server.backend.in_flight >= 4, "the flood to reach the runtime")
        single = threading.Thread(target=call, args=("single", single_run))
        single.start()
        for thread in [*flood, single]:
            thread.join(timeout=300)
    finally:
        backend_log.removeHandler(handler)
        backend_log.setLevel(level)
    assert sorted(order) == sorted([f"flood-{i}" for i in range(20)] + ["single"])
    assert len(finished_before_arrival) == 1
    # Served in the tick after it reached the runtime. Counted as the clients see answers, so at most the calls of
    # three ticks (4 runs each) finish between: the tick running when it arrived, the tick that serves it, and the next,
    # whose answers may overtake its own on the way back (recording, HTTP). Served after the flood would be 20.
    assert order.index("single") - finished_before_arrival[0] <= 12
    assert [len(run.metrics(name="loss:mean")) for run in runs] == [5, 5, 5, 5]  # each flood call applied once
