"""A /v1 chat request is one runtime round trip (issue 29): the sample call carries the messages, the runtime renders
them and answers the prompt ids, EOS ids and the tokens' text with the sample. Counted from the backend's
"sent to the runtime" log line, one per call written to the runtime's connection."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    key = live_server.new_user()
    run_id = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4).id
    chat = openai.OpenAI(api_key=key, base_url=f"{live_server.url}/v1", max_retries=0)
    chat.model = run_id  # type: ignore[attr-defined]  # the run the tests sample, kept with its client
    return chat


def sent(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "signal.backend" and "sent to the runtime" in r.getMessage()]


@pytest.mark.parametrize("extra", [
    {},
    {"stop": ["e"], "max_tokens": 12},
    {"logprobs": True, "top_logprobs": 2, "max_tokens": 6},
    {"stream": True, "max_tokens": 8},
], ids=["plain", "stop", "logprobs", "stream"])
def test_a_chat_request_is_one_runtime_call(client: openai.OpenAI, caplog: pytest.LogCaptureFixture,
                                            extra: dict[str, Any]) -> None:
    model = client.model  # type: ignore[attr-defined]
    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    caplog.set_level(logging.DEBUG, logger="signal.backend")
    caplog.clear()
    answer = client.chat.completions.create(model=model, messages=messages, seed=3, **extra)
    if extra.get("stream"):
        chunks = list(answer)  # type: ignore[call-overload]
        assert chunks and chunks[0].choices[0].delta.role == "assistant"
    else:
        assert answer.usage is not None and answer.usage.prompt_tokens > 0  # type: ignore[union-attr]
        if "logprobs" in extra:
            assert answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(sent(caplog)) == 1, sent(caplog)
    assert "sample" in sent(caplog)[0].lower()
