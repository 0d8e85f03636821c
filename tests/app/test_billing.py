"""Billing hooks end to end (docs/BILLING.md): a live Signal server with FRONTIER_BACKEND_URL pointed at a stand-in
of the billing backend (tests/helpers/billing_standin.py, TESTS ONLY: the real backend cannot be reached from
here), which approves, refuses, hangs, answers 500, or sees a duplicate idempotency key.

- credits are validated before createRun and each primitive; a refusal is INSUFFICIENT_CREDITS and an unreachable
  backend BILLING_UNAVAILABLE (HTTP 200, GraphQL errors), and then nothing trains;
- each primitive is deducted once by its compute seconds, keyed by its idempotency id, through the outbox: a retry
  is charged once, a backend that was down is charged when it is back, a server restart charges what was owed;
- the HF token comes from get-integrations at export time and is written nowhere;
- with the URL unset, no billing call is made and runs still record their compute seconds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from app.db import Database
from app.tables import BillingOutbox
from rewardsignal import BadInputError, BillingUnavailableError, InsufficientCreditsError, SignalClient
from tests.helpers.billing_standin import BillingStandIn
from tests.helpers.hub_standin import HubStandIn
from tests.helpers.live_server import LiveServer, error_code, free_port, settings_for
from tests.helpers.transports import DropFirstAnswer

SECRET = "billing-secret-5d1c"
RATE = 2.5  # credits per GPU-second
CPU_RATE = 0.75  # credits per compute second on the CPU: what every run here trains on
HF_TOKEN = "hf_billing_integration_3e8b1f0a9c"  # distinctive, so a grep finds every copy
BATCH = [{"input": "Q: What is 2 + 2?\nA:", "output": " 4"}, {"text": "The quick brown fox jumps over the lazy dog."}]
VALIDATE, DEDUCT, INTEGRATIONS = "/internal/validate-credits", "/internal/deduct-credits", "/internal/get-integrations"
FB = """mutation($id: ID!, $batch: [BatchItem!]!, $rid: String) {
    forwardBackward(runId: $id, batch: $batch, requestId: $rid) { loss step } }"""
RUN = "query($id: ID!) { run(id: $id) { step computeSeconds gpuSeconds cost metrics { name } } }"


@pytest.fixture(scope="module")
def billing() -> Iterator[BillingStandIn]:
    standin = BillingStandIn(secret=SECRET).start()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandIn]:
    standin = HubStandIn(token=HF_TOKEN).start()
    yield standin
    standin.stop()


def billed_settings(data_dir: Path, tiny_model_dir: str, billing: BillingStandIn) -> Any:
    return settings_for(data_dir, tiny_model_dir, frontier_backend_url=billing.url, billing_secret=SECRET,
                        billing_timeout_s=0.5, billing_retry_s=3600, gpu_second_rate=RATE,
                        cpu_second_rate=CPU_RATE, worker_log=data_dir / "worker.log")


@pytest.fixture(scope="module")
def server(billing: BillingStandIn, hub: HubStandIn, tiny_model_dir: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("billing-data")
    with pytest.MonkeyPatch.context() as env:  # the runtime (a subprocess) pushes to the Hub stand-in
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HUB_DISABLE_XET", "1")
        env.delenv("HF_TOKEN", raising=False)
        live = LiveServer.start(billed_settings(data_dir, tiny_model_dir, billing))
    yield live
    live.stop()


@pytest.fixture(autouse=True)
def approving(billing: BillingStandIn) -> Iterator[None]:
    billing.validate, billing.deduct = "approve", "approve"
    billing.release.clear()
    yield
    billing.release.set()  # ends a hang the test left


def user(server: LiveServer) -> tuple[SignalClient, str]:
    client = SignalClient(api_key=server.new_user(), base_url=server.url, retry_backoff=0.01)
    return client, client.me()["id"]


def run_state(server: LiveServer, client: SignalClient, run_id: str) -> dict[str, Any]:
    body = server.graphql(RUN, {"id": run_id}, key=client.api_key)
    assert "errors" not in body, body
    return body["data"]["run"]


def outbox(server: LiveServer, run_id: str) -> list[BillingOutbox]:
    async def read() -> list[BillingOutbox]:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                return list(await session.scalars(select(BillingOutbox).where(BillingOutbox.run_id == run_id)))
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, read()).result()


def wait_charged(billing: BillingStandIn, run_id: str, count: int) -> list[dict[str, Any]]:
    billing.wait_until(lambda: len([d for d in billing.charged.values() if d["run_id"] == run_id]) >= count,
                       f"{count} deductions for run {run_id}")
    return [d for d in billing.charged.values() if d["run_id"] == run_id]


def test_credits_are_checked_before_each_call_and_each_primitive_is_deducted(server: LiveServer,
                                                                              billing: BillingStandIn) -> None:
    client, user_id = user(server)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=1e-2)
    run.sample(prompts=["hello"], max_tokens=3, seed=1)
    run.save_state()

    checked = billing.calls(VALIDATE, user_id=user_id)
    assert [c["operation"] for c in checked] == ["create_run", "forward_backward", "optim_step", "sample", "save_state"]
    assert {c["run_id"] for c in checked} == {run.id}
    assert checked[0]["gpu_type"] == "L40S" and checked[0]["gpu_count"] == 1  # createRun: the requested allocation
    assert checked[0]["device"] is None and checked[0]["credits_per_cpu_second"] == CPU_RATE
    for check in checked[1:]:  # then what the run trains on: this machine's CPU, not the L40S it asked for
        assert (check["device"], check["gpu_type"], check["gpu_count"]) == ("cpu", "cpu", 0)

    deductions = wait_charged(billing, run.id, 4)
    assert sorted(d["operation"] for d in deductions) == ["forward_backward", "optim_step", "sample", "save_state"]
    for deduction in deductions:
        assert deduction["user_id"] == user_id and deduction["compute_seconds"] > 0
        assert deduction["idempotency_key"].startswith(f"{run.id}:")
        uuid.UUID(deduction["idempotency_key"].split(":", 1)[1])  # the SDK's request id
        # A CPU run: no GPU-seconds, its compute seconds at the CPU rate.
        assert (deduction["device"], deduction["gpu_type"], deduction["gpu_count"]) == ("cpu", "cpu", 0)
        assert deduction["gpu_seconds"] == 0
        assert deduction["credits"] == pytest.approx(deduction["compute_seconds"] * CPU_RATE)
    state = run_state(server, client, run.id)
    assert state["computeSeconds"] == pytest.approx(sum(d["compute_seconds"] for d in deductions))
    assert state["gpuSeconds"] == 0
    assert state["cost"] == pytest.approx(state["computeSeconds"] * CPU_RATE) and state["cost"] > 0
    assert state["cost"] == pytest.approx(sum(d["credits"] for d in deductions))
    assert run.refresh().info["compute_seconds"] == pytest.approx(state["computeSeconds"])  # the SDK's fragment


def test_v1_requests_on_a_snapshot_and_a_base_are_checked_and_deducted(server: LiveServer,
                                                                          billing: BillingStandIn) -> None:
    """/v1 bills like sample: a snapshot's request to its run, a base model's to the user with no run."""
    import openai

    client, user_id = user(server)
    run = client.create_run(lora_r=4)
    run.save_weights_for_sampler(name="billed")
    v1 = openai.OpenAI(api_key=client.api_key, base_url=f"{server.url}/v1", max_retries=0, timeout=300)
    for model in (f"{run.id}@billed", "tiny-llama"):
        v1.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

    checked = [(c["operation"], c["run_id"]) for c in billing.calls(VALIDATE, user_id=user_id)]
    assert checked[-2:] == [("sample", run.id), ("sample", "")]
    billing.wait_until(lambda: len([d for d in billing.charged.values() if d["user_id"] == user_id
                                    and d["operation"] == "sample"]) >= 2, "the two /v1 deductions")
    deductions = {d["run_id"]: d for d in billing.charged.values() if d["user_id"] == user_id
                  and d["operation"] == "sample"}
    assert set(deductions) == {run.id, ""}
    assert deductions[""]["idempotency_key"].startswith(f"user:{user_id}:")
    assert all(d["compute_seconds"] > 0 for d in deductions.values())
    on_run = wait_charged(billing, run.id, 2)  # save_weights_for_sampler and the snapshot's request
    assert sorted(d["operation"] for d in on_run) == ["sample", "save_weights_for_sampler"]
    assert run_state(server, client, run.id)["computeSeconds"] == pytest.approx(sum(d["compute_seconds"]
                                                                                    for d in on_run))


@pytest.mark.parametrize("mode", ["refuse", "refuse_200"])
def test_a_refusing_backend_is_insufficient_credits_and_nothing_trains(server: LiveServer, billing: BillingStandIn,
                                                                       mode: str) -> None:
    client, _ = user(server)
    run = client.create_run(lora_r=4)
    billing.validate = mode
    with pytest.raises(InsufficientCreditsError) as refused:
        run.forward_backward(batch=BATCH)
    assert refused.value.code == "INSUFFICIENT_CREDITS"
    assert str(refused.value).endswith("Your balance is 0 credits: top up to keep training." if mode == "refuse"
                                       else "Credits exhausted.")
    raw = httpx.post(f"{server.url}/graphql", json={"query": FB, "variables": {"id": run.id, "batch": BATCH}},
                     headers={"Authorization": f"Bearer {client.api_key}"})
    assert raw.status_code == 200 and error_code(raw.json()) == "INSUFFICIENT_CREDITS"  # never an HTTP 402
    with pytest.raises(InsufficientCreditsError):
        client.create_run(lora_r=4)
    state = run_state(server, client, run.id)
    assert (state["step"], state["metrics"], state["computeSeconds"]) == (0, [], 0)
    assert outbox(server, run.id) == []


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_an_unreachable_backend_is_billing_unavailable_and_nothing_trains(server: LiveServer,
                                                                          billing: BillingStandIn, mode: str) -> None:
    client, user_id = user(server)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    before = run_state(server, client, run.id)
    billing.validate = mode
    for call in (lambda: run.optim_step(learning_rate=1e-2), lambda: run.forward_backward(batch=BATCH),
                 lambda: run.sample(prompts=["hi"], max_tokens=2)):
        with pytest.raises(BillingUnavailableError) as unavailable:
            call()
        expected = "did not answer /internal/validate-credits within 0.5s" if mode == "hang" else "HTTP 500"
        assert expected in str(unavailable.value)
    assert run_state(server, client, run.id) == before  # no step, no metric, no compute seconds
    assert [o.operation for o in outbox(server, run.id)] == ["forward_backward"]
    billing.validate = "approve"
    assert run.optim_step(learning_rate=1e-2).step == 1


def test_a_retried_request_is_charged_once(server: LiveServer, billing: BillingStandIn) -> None:
    client, user_id = user(server)
    run = client.create_run(lora_r=4)
    rid = str(uuid.uuid4())
    first = server.graphql(FB, {"id": run.id, "batch": BATCH, "rid": rid}, key=client.api_key)
    again = server.graphql(FB, {"id": run.id, "batch": BATCH, "rid": rid}, key=client.api_key)
    assert "errors" not in again and again["data"] == first["data"]

    # The SDK sends a call whose answer was lost again, with the same id.
    transport = DropFirstAnswer("OptimStep")
    dropping = SignalClient(api_key=client.api_key, base_url=server.url, transport=transport, retry_backoff=0.01)
    assert dropping.get_run(run.id).optim_step(learning_rate=1e-2).step == 1
    assert len(transport.sent) == 2 and transport.sent[0] == transport.sent[1]

    deductions = wait_charged(billing, run.id, 2)
    keys = sorted(d["idempotency_key"] for d in deductions)
    assert keys == sorted([f"{run.id}:{rid}", f"{run.id}:{transport.sent[0]['requestId']}"])
    assert len(outbox(server, run.id)) == 2
    # Each retry found its call charged: it was not validated again either.
    assert [c["operation"] for c in billing.calls(VALIDATE, user_id=user_id)] == [
        "create_run", "forward_backward", "optim_step"]


def test_a_deduction_the_backend_already_took_is_settled_by_its_409(server: LiveServer,
                                                                   billing: BillingStandIn) -> None:
    client, _ = user(server)
    run = client.create_run(lora_r=4)
    billing.deduct = "lost_answer"
    run.forward_backward(batch=BATCH)
    server.wait_for(lambda: any(o.attempts for o in outbox(server, run.id)), "the first deduction attempt", 30)
    [owed] = outbox(server, run.id)
    assert owed.sent_at is None and owed.last_error == "HTTP 500"
    billing.deduct = "approve"
    run.forward_backward(batch=BATCH)  # the drain after it sends the first again: the backend answers 409
    server.wait_for(lambda: all(o.sent_at for o in outbox(server, run.id)) and len(outbox(server, run.id)) == 2,
                    "both deductions settled", 30)
    assert owed.idempotency_key in billing.duplicates
    assert len([d for d in billing.charged.values() if d["run_id"] == run.id]) == 2  # charged once each


def test_deductions_wait_in_the_outbox_until_the_backend_is_back(server: LiveServer, billing: BillingStandIn) -> None:
    client, _ = user(server)
    run = client.create_run(lora_r=4)
    billing.deduct = "error"
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=1e-2)  # training goes on while the deductions wait
    server.wait_for(lambda: any(o.attempts for o in outbox(server, run.id)), "a failed deduction attempt", 30)
    assert not any(o.sent_at for o in outbox(server, run.id))
    assert [d for d in billing.charged.values() if d["run_id"] == run.id] == []
    billing.deduct = "approve"
    run.sample(prompts=["hi"], max_tokens=2, seed=1)
    assert sorted(d["operation"] for d in wait_charged(billing, run.id, 3)) == [
        "forward_backward", "optim_step", "sample"]


def test_a_deduction_owed_when_the_server_stopped_is_charged_after_restart(
        billing: BillingStandIn, tiny_model_dir: str, tmp_path: Path) -> None:
    settings = billed_settings(tmp_path / "data", tiny_model_dir, billing)
    first = LiveServer.start(settings)
    try:
        client, _ = user(first)
        run = client.create_run(lora_r=4)
        billing.deduct = "error"  # the backend is down: the deduction stays owed
        run.forward_backward(batch=BATCH)
        first.wait_for(lambda: any(o.attempts for o in outbox(first, run.id)), "a failed deduction attempt", 30)
    finally:
        first.stop()
    assert [d for d in billing.charged.values() if d["run_id"] == run.id] == []
    billing.deduct = "approve"
    second = LiveServer.start(settings.model_copy(update={"port": free_port()}), wait_for_runtime=False)
    try:
        [deduction] = wait_charged(billing, run.id, 1)  # sent at start, before any call
        assert deduction["operation"] == "forward_backward" and deduction["compute_seconds"] > 0
    finally:
        second.stop()


def test_the_hf_token_comes_from_the_integrations_at_export_and_is_stored_nowhere(
        server: LiveServer, billing: BillingStandIn, hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)  # the SDK sends no hfToken
    client, user_id = user(server)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    with pytest.raises(BadInputError) as missing:  # no integration for this user yet
        run.save_state(push_to_hub=True, hub_model_id="bob/billed")
    assert missing.value.field == "hfToken" and "integration" in str(missing.value)
    assert billing.calls(INTEGRATIONS, user_id=user_id) == [{"user_id": user_id, "integrations": ["huggingface"]}]

    billing.hf_tokens[user_id] = HF_TOKEN
    run.save_state(push_to_hub=True, hub_model_id="bob/billed")
    assert "bob/billed" in hub.repos and hub.authorizations[-1] == f"Bearer {HF_TOKEN}"
    assert len(billing.calls(INTEGRATIONS, user_id=user_id)) == 2  # fetched when used, each time
    leaks = [str(p) for p in Path(server.settings.data_dir).rglob("*") if p.is_file() and HF_TOKEN.encode() in p.read_bytes()]
    assert leaks == []
    assert not any(HF_TOKEN in json.dumps(o.__dict__, default=str) for o in outbox(server, run.id))


def test_without_a_backend_url_no_billing_call_is_made(live_server: LiveServer, billing: BillingStandIn) -> None:
    assert not live_server.settings.billing_enabled and live_server.app.state.services.billing is None
    before = len(billing.requests)
    client = SignalClient(api_key=live_server.new_user(), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=1e-2)
    with pytest.raises(BadInputError) as missing:
        run.save_state(push_to_hub=True, hub_model_id="bob/x")
    assert missing.value.field == "hfToken" and "integration" not in str(missing.value)
    assert len(billing.requests) == before
    assert outbox(live_server, run.id) == []
    state = run_state(live_server, client, run.id)
    assert state["computeSeconds"] > 0 and state["cost"] == pytest.approx(state["gpuSeconds"] * 1.0)


