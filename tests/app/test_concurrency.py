"""Calls on one run keep arrival order; calls on different runs do not disturb each other;
the event loop stays free while the worker trains."""

from __future__ import annotations

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
    losses = [m.value for m in run.metrics(name="loss")]
    assert len(losses) == 6 and max(losses) - min(losses) < 1e-6  # same weights each time: no step in between


def test_healthz_answers_while_a_run_trains(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    busy = threading.Thread(target=run.sample, kwargs={"prompts": ["hello"] * 4, "max_tokens": 120,
                                                       "temperature": 1.0, "num_samples": 2})
    busy.start()
    answers = []
    while busy.is_alive() and len(answers) < 50:
        response = httpx.get(f"{live_server.url}/healthz", timeout=10)
        answers.append((response.status_code, busy.is_alive()))
    busy.join(timeout=300)
    # At least one health check was answered while the sample was still running in the worker.
    assert any(status == 200 and running for status, running in answers)
