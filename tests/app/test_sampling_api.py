"""Token-level sampling and the tokenizer over GraphQL and the SDK, against a live server on the tiny model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rewardsignal import AsyncSignalClient, SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, error_code
from tests.helpers.modal_server import LOCAL_WARNING, live_server_on_both_backends  # noqa: F401 - the fixture: every test on both backends

pytestmark = pytest.mark.filterwarnings(LOCAL_WARNING)


SAMPLE = ("mutation($id: ID!, $prompts: [String!], $tokens: [[Int!]!], $stop: [String!], $stopTokens: [Int!], "
          "$store: Boolean, $promptLogprobs: Boolean! = false) { sample(runId: $id, prompts: $prompts, "
          "promptTokens: $tokens, maxTokens: 4, temperature: 0, stop: $stop, stopTokens: $stopTokens, store: $store, "
          "promptLogprobs: $promptLogprobs) { outputs promptTokens promptLogprobs "
          "sequences { text tokens logprobs stopReason } } }")
SAMPLES = "query($id: ID!) { run(id: $id) { samples { prompt output } } }"


@pytest.fixture(scope="module")
def run_id(live_server: LiveServer) -> tuple[str, str]:
    key = live_server.new_user()
    created = live_server.graphql("mutation { createRun(input: {loraR: 4}) { id } }", key=key)
    assert "errors" not in created, created
    return created["data"]["createRun"]["id"], key


def sample(live_server: LiveServer, run: tuple[str, str], **variables: Any) -> dict[str, Any]:
    return live_server.graphql(SAMPLE, {"id": run[0], **variables}, key=run[1])


def stored(live_server: LiveServer, run: tuple[str, str]) -> list[dict[str, str]]:
    body = live_server.graphql(SAMPLES, {"id": run[0]}, key=run[1])
    assert "errors" not in body, body
    return body["data"]["run"]["samples"]


@pytest.mark.parametrize(("store", "rows"), [(False, 0), (None, 2), (True, 2)], ids=["false", "omitted", "true"])
def test_store_false_writes_no_sample_rows(live_server: LiveServer, run_id: tuple[str, str], store: bool | None,
                                           rows: int) -> None:
    before = len(stored(live_server, run_id))
    body = sample(live_server, run_id, prompts=["hello", "world"], store=store)
    assert "errors" not in body, body
    assert len(stored(live_server, run_id)) - before == rows


def test_token_prompts_answer_as_their_text_and_are_stored_as_ids(live_server: LiveServer,
                                                                   run_id: tuple[str, str]) -> None:
    by_text = sample(live_server, run_id, prompts=["The quick brown"], promptLogprobs=True)
    assert "errors" not in by_text, by_text
    ids = by_text["data"]["sample"]["promptTokens"]
    by_ids = sample(live_server, run_id, tokens=ids, promptLogprobs=True)
    assert "errors" not in by_ids, by_ids
    assert by_ids["data"] == by_text["data"]
    logprobs = by_ids["data"]["sample"]["promptLogprobs"][0]
    assert len(logprobs) == len(ids[0]) and logprobs[0] is None and all(x < 0 for x in logprobs[1:])
    assert stored(live_server, run_id)[0]["prompt"] == str(ids[0])  # the newest row: the ids' JSON list


def test_stop_token_ids_stop_over_graphql(live_server: LiveServer, run_id: tuple[str, str]) -> None:
    full = sample(live_server, run_id, prompts=["hello"], store=False)["data"]["sample"]["sequences"][0][0]
    stop = full["tokens"][1]
    first = full["tokens"].index(stop)
    body = sample(live_server, run_id, prompts=["hello"], stopTokens=[stop], store=False)
    assert "errors" not in body, body
    seq = body["data"]["sample"]["sequences"][0][0]
    assert seq["tokens"] == full["tokens"][:first + 1] and seq["stopReason"] == "stop"


@pytest.mark.parametrize(("variables", "field"), [
    ({"prompts": ["hello"], "stop": ["x"], "stopTokens": [3]}, "stop"),
    ({"prompts": ["hello"], "tokens": [[1, 2]]}, "prompts"),
    ({}, "prompts"),
    ({"tokens": [[1, 10**6]]}, "promptTokens[0]"),
    ({"prompts": ["hello"], "stopTokens": [10**6]}, "stopTokens"),  # the argument sent, not the contract's merged stop
], ids=["stop-and-stopTokens", "both-prompts", "no-prompts", "token-outside-vocab", "stop-token-outside-vocab"])
def test_bad_token_level_arguments_name_their_field(live_server: LiveServer, run_id: tuple[str, str],
                                                    variables: dict[str, Any], field: str) -> None:
    body = sample(live_server, run_id, **variables)
    assert error_code(body) == "BAD_INPUT", body
    assert body["errors"][0]["extensions"]["field"] == field


TOKENIZER = ("query($runId: ID, $baseModel: String) { tokenizer(runId: $runId, baseModel: $baseModel) "
             "{ name vocabSize eosTokenIds bosTokenId padTokenId chatTemplate } }")


@pytest.mark.parametrize("by", ["runId", "baseModel", "default"])
def test_the_tokenizer_query(live_server: LiveServer, run_id: tuple[str, str], tiny_model_dir: str, by: str) -> None:
    variables = {"runId": {"runId": run_id[0]}, "baseModel": {"baseModel": TINY_MODEL}, "default": {}}[by]
    body = live_server.graphql(TOKENIZER, variables, key=run_id[1])
    assert "errors" not in body, body
    described = body["data"]["tokenizer"]
    assert described["name"] == tiny_model_dir and described["vocabSize"] == 49152
    assert described["eosTokenIds"] == [2] and described["bosTokenId"] == 1  # the tiny model's SmolLM2 tokenizer
    assert "{%" in described["chatTemplate"]


def test_the_tokenizer_of_another_users_run_is_not_found(live_server: LiveServer, run_id: tuple[str, str]) -> None:
    body = live_server.graphql(TOKENIZER, {"runId": run_id[0]}, key=live_server.new_user())
    assert error_code(body) == "NOT_FOUND"


def test_the_sdk_samples_token_ids_with_token_stops_and_reads_the_tokenizer(live_server: LiveServer,
                                                                           run_id: tuple[str, str]) -> None:
    client = SignalClient(api_key=run_id[1], base_url=live_server.url)
    run = client.get_run(run_id[0])
    eos = run.tokenizer().eos_token_ids
    assert client.tokenizer().eos_token_ids == eos == [2]
    ids = run.sample("The quick brown", max_tokens=1, store=False).prompt_tokens
    full = run.sample(prompt_tokens=ids, max_tokens=4, temperature=0, store=False).sequences[0][0]
    answer = run.sample(prompt_tokens=ids, max_tokens=4, temperature=0, stop=[full.tokens[0]], topk_sample_logprobs=2,
                        store=False)
    seq = answer.sequences[0][0]
    assert seq.tokens == full.tokens[:1] and seq.stop_reason == "stop"
    assert [pair.token for pair in seq.topk_logprobs[0]][0] == full.tokens[0]  # greedy took the most likely

    async def described() -> Any:
        async with AsyncSignalClient(api_key=run_id[1], base_url=live_server.url) as aclient:
            return await aclient.tokenizer(base_model=TINY_MODEL)

    assert asyncio.run(described()).eos_token_ids == [2]


CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What does Signal train?"}]


def test_the_sdk_samples_chat_messages_through_the_bases_template(live_server: LiveServer, run_id: tuple[str, str],
                                                                   tiny_model_dir: str) -> None:
    """`sample(messages=…)` renders each chat with the base's chat template and the assistant's turn opened, as /v1
    does: its prompt is the template's ids, and it answers as the same ids sent as tokens."""
    from transformers import AutoTokenizer

    expected = list(AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False))
    client = SignalClient(api_key=run_id[1], base_url=live_server.url)
    run = client.get_run(run_id[0])
    chat = run.sample(messages=CHAT, max_tokens=4, temperature=0, store=False)
    assert chat.prompt_tokens == [expected]
    tokens = run.sample(prompt_tokens=[expected], max_tokens=4, temperature=0, store=False)
    assert chat.outputs == tokens.outputs
    two = client.sample_base(messages=[CHAT, CHAT[1:]], base_model=TINY_MODEL, max_tokens=2, temperature=0)
    assert two.prompt_tokens[0] == expected and len(two.prompt_tokens) == 2


@pytest.mark.parametrize("variables", [{"prompts": ["hi"]}, {"messages": []}, {"messages": [[]]}],
                         ids=["with-prompts", "no-chats", "an-empty-chat"])
def test_bad_chat_prompts_name_messages(live_server: LiveServer, run_id: tuple[str, str],
                                        variables: dict[str, Any]) -> None:
    query = ("mutation($id: ID!, $prompts: [String!], $messages: [[MessageInput!]!]) { sample(runId: $id, "
             "prompts: $prompts, messages: $messages) { outputs } }")
    body = live_server.graphql(query, {"id": run_id[0], "messages": [CHAT], **variables}, key=run_id[1])
    assert error_code(body) == "BAD_INPUT" and body["errors"][0]["extensions"]["field"] == "messages", body
