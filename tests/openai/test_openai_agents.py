"""The OpenAI Agents SDK's default path (Runner over the Responses API) running one agent with one function tool
against a live server, on the tiny model under a Hermes tool template (tests/conftest.py's tool_server).

`openai-agents` is in the dev extras (it pins websockets<17, so the server pins websockets 16.1)."""

from __future__ import annotations

import asyncio
from typing import Any

import agents
import openai
import pytest

from tests.helpers.live_server import LiveServer
from tests.openai.test_openai_responses import SCHEMA

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def key(tool_server: LiveServer) -> str:
    return tool_server.new_user()


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_runs_an_agent_with_a_function_tool(tool_server: LiveServer, key: str, streamed: bool) -> None:
    """Runner over the Responses API (the SDK's default), the call forced by name; the tool takes the model's
    arguments as it wrote them (a random model's may not be JSON), then the SDK resets tool_choice to answer. The SDK
    fails a run whose answer is cut at max_output_tokens (status incomplete), so the random model is stopped early by
    a stop string (Signal's extra: greedy, it writes newlines)."""
    seen: list[str] = []

    async def add(context: Any, arguments: str) -> str:
        seen.append(arguments)
        return "5"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(api_key=key, base_url=f"{tool_server.url}/v1", max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    tool = agents.FunctionTool(name="add", description="Add two integers", params_json_schema=SCHEMA,
                               on_invoke_tool=add, strict_json_schema=False)
    settings = agents.ModelSettings(tool_choice="add", max_tokens=24, temperature=0, extra_body={"stop": ["\n"]})
    agent = agents.Agent(name="calculator", instructions="Use the add tool.", tools=[tool], model="tiny-hermes",
                         model_settings=settings)
    if streamed:
        async def run() -> list[str]:
            running = agents.Runner.run_streamed(agent, "What is 2+3?", max_turns=3)
            async for _ in running.stream_events():
                pass
            return [item.type for item in running.new_items] if isinstance(running.final_output, str) else []
        kinds = asyncio.run(run())
    else:
        result = agents.Runner.run_sync(agent, "What is 2+3?", max_turns=3)
        kinds = [item.type for item in result.new_items] if isinstance(result.final_output, str) else []
    assert len(seen) == 1
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
