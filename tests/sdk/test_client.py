"""The SDK against a real server: the README's surface, typed errors, env defaults, the async twin."""

from __future__ import annotations

import json

import httpx
import pytest

import rewardsignal
from gpu_runtime.contract import ADAM_DEFAULTS, LORA_DEFAULTS
from rewardsignal import (
    AsyncSignalClient,
    AuthenticationError,
    BadInputError,
    FailedPreconditionError,
    NotFoundError,
    SignalClient,
    TransportError,
)
from tests.helpers.live_server import LiveServer, free_port

BATCH = [{"input": "The quick brown fox jumps over the lazy dog."},
         {"output": "Machine learning is transforming technology."}]


def test_reads_key_and_url_from_the_environment(live_server: LiveServer, key: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SIGNAL_API_KEY", key)
    monkeypatch.setenv("SIGNAL_BASE_URL", live_server.url)
    client = SignalClient()
    assert client.me().email.endswith("@example.com")


def test_results_allow_keys_and_attributes(live_server: LiveServer, key: str) -> None:
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, lora_alpha=8, seed=1)
    assert run.info.lora_r == 4 and run.info["lora_alpha"] == 8.0
    assert isinstance(run.info.trainable_params, int) and run.info.trainable_params > 0
    assert run.info.optimizer["learning_rate"] == 1e-4  # JSON fields keep the engine's keys
    result = run.forward_backward(batch=BATCH)
    assert result["loss"] == result.loss and result.num_examples == 2 and result.num_tokens > 0
    step = run.optim_step(learning_rate=0.05, grad_clip_norm=0.0)
    assert step.step == 1 and step.learning_rate == 0.05
    samples = run.sample(prompts=["The meaning of life is"], temperature=0.7, max_tokens=8, seed=5)
    assert isinstance(samples["outputs"][0], str)
    assert samples.sequences[0][0].stop_reason in ("stop", "length")
    artifact = run.save_state(mode="adapter", push_to_hub=False)
    assert artifact["checkpoint_path"].endswith("checkpoints/adapter_step_1")
    assert artifact.size_bytes > 0
    assert [c.mode for c in run.checkpoints()] == ["adapter"]
    assert [m.name for m in run.metrics()] == ["loss:mean", "num_tokens", "num_examples", "throughput", "grad_norm",
                                             "learning_rate"]
    assert run.refresh().step == 1


def test_errors_are_typed_and_carry_the_code(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    with pytest.raises(BadInputError) as bad:
        client.create_run(lora_r=1000)
    assert bad.value.code == "BAD_INPUT" and bad.value.field == "loraR" and isinstance(bad.value, ValueError)
    with pytest.raises(NotFoundError):
        client.get_run("0" * 32)
    run = client.create_run(lora_r=4)
    with pytest.raises(FailedPreconditionError):
        run.optim_step()
    with pytest.raises(BadInputError, match="hfToken") as no_token:
        run.save_state(mode="merged", push_to_hub=True, hub_model_id="me/model", hf_token="")
    assert no_token.value.field == "hfToken"
    with pytest.raises(AuthenticationError):
        SignalClient(api_key="sk-nope", base_url=live_server.url).list_runs()
    with pytest.raises(TransportError):
        SignalClient(api_key=key, base_url=f"http://127.0.0.1:{free_port()}").list_models()


def test_keys_and_runs_listing(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    created = client.create_api_key("ci")
    assert created.secret.startswith("sk-") and created.api_key.name == "ci"
    assert created.api_key.id in [k.id for k in client.list_api_keys()]
    assert client.revoke_api_key(created.api_key.id).revoked is True
    first, second = client.create_run(lora_r=2), client.create_run(lora_r=2)
    assert [r.id for r in client.list_runs()][:2] == [second.id, first.id]
    assert second.delete() is True
    assert [r.id for r in client.list_runs()] == [first.id]


async def test_async_client_has_the_same_surface(live_server: LiveServer, key: str) -> None:
    async with AsyncSignalClient(api_key=key, base_url=live_server.url) as client:
        assert "tiny-llama" in await client.list_models()
        run = await client.create_run(lora_r=4)
        assert isinstance(run, rewardsignal.AsyncRun)
        losses = []
        for _ in range(3):
            losses.append((await run.forward_backward(batch=BATCH)).loss)
            await run.optim_step(learning_rate=0.01)
        assert losses[-1] < losses[0]
        assert (await run.refresh()).step == 3
        with pytest.raises(NotFoundError):
            await client.get_run("missing")


class Recording(httpx.HTTPTransport):
    """Forwards every request and keeps the GraphQL variables each one carried."""

    def __init__(self) -> None:
        super().__init__()
        self.variables: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.variables.append(json.loads(request.content)["variables"])
        return super().handle_request(request)


def test_create_run_leaves_unset_settings_to_the_server(live_server: LiveServer, key: str) -> None:
    transport = Recording()
    run = SignalClient(api_key=key, base_url=live_server.url, transport=transport).create_run()
    assert transport.variables == [{"input": {}}]  # nothing hard-coded on this side
    assert (run.info.lora_r, run.info.lora_alpha) == (LORA_DEFAULTS["r"], LORA_DEFAULTS["alpha"])
    assert run.info.optimizer == ADAM_DEFAULTS


class AsyncDropFirstAnswer(httpx.AsyncHTTPTransport):
    """The network boundary: the first answer to ForwardBackward is lost after the server applied the call."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        payload = json.loads(request.content)
        if payload.get("operationName") == "ForwardBackward":
            self.sent.append(payload["variables"])
            if len(self.sent) == 1:
                await response.aread()
                await response.aclose()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


async def test_async_client_sends_a_dropped_call_again(live_server: LiveServer, key: str) -> None:
    transport = AsyncDropFirstAnswer()
    async with AsyncSignalClient(api_key=key, base_url=live_server.url, transport=transport,
                                 retry_backoff=0.01) as client:
        run = await client.create_run(lora_r=4)
        assert (await run.forward_backward(batch=BATCH)).num_examples == 2
    first, retry = transport.sent
    assert first == retry and first["requestId"]
    async with AsyncSignalClient(api_key=key, base_url=live_server.url, transport=AsyncDropFirstAnswer(),
                                 max_attempts=1) as once:
        with pytest.raises(TransportError):  # retries are bounded: one attempt here
            await (await once.get_run(run.id)).forward_backward(batch=BATCH)
