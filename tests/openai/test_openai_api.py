"""The /v1 endpoint with the official `openai` package as the client (sync, async, streaming), on a live server with
the tiny model: shapes, stops, repeatability, logprobs against Signal's forward, usage, errors, records."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def owner(live_server: LiveServer) -> tuple[str, str]:
    """A user's key and a run of theirs (one per module: every test reads, none trains)."""
    key = live_server.new_user()
    return key, SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4).id


@pytest.fixture
def client(live_server: LiveServer, owner: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(api_key=owner[0], base_url=f"{live_server.url}/v1", max_retries=0)


def teacher_forced(live_server: LiveServer, key: str, run_id: str, ids: list[int]) -> list[float]:
    """Signal's forward on `ids`: the logprob of each token after the first."""
    run = SignalClient(api_key=key, base_url=live_server.url).get_run(run_id)
    datum = {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}}
    return list(run.forward([datum])["outputs"][0]["logprobs"])


def test_models_list_the_callers_runs_and_get_one(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    assert owner[1] in [m.id for m in client.models.list().data]
    assert client.models.retrieve(owner[1]).id == owner[1]


def test_a_chat_completion(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    answer = client.chat.completions.create(model=owner[1], messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    extra = answer.model_extra or {}
    prompt_ids = extra["prompt_token_ids"]
    assert prompt_ids[0] != prompt_ids[1] or prompt_ids[0] not in (1,)  # the template's BOS once, not twice
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    generated = (choice.model_extra or {})["token_ids"]
    assert answer.usage.completion_tokens == len(generated) + (choice.finish_reason == "stop")


def test_a_prompt_sent_again_reports_its_cached_tokens(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    """The second request's prompt is found in the decode cache but for its last token (whose pass gives the first
    logits): OpenAI's `usage.prompt_tokens_details.cached_tokens`. Long enough for whole blocks of the prefix index."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about the quick brown fox and the lazy dog. " * 4}]
    first, again = (client.chat.completions.create(model=owner[1], messages=messages, max_tokens=2, seed=seed)
                    for seed in (1, 2))
    assert first.usage and again.usage and first.usage.prompt_tokens == again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details and first.usage.prompt_tokens_details
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert first.usage.prompt_tokens_details.cached_tokens in (0, first.usage.prompt_tokens - 1)  # 0 unless sent before


@pytest.mark.parametrize("prompt, count", [(["Hello there", "The sky is"], 2), ([[28120, 905, 314]], 1),
                                           ([[28120, 905], [260, 3575, 282]], 2), ([28120, 905, 314], 1)])
def test_completions_take_prompt_lists_and_token_ids(client: openai.OpenAI, owner: tuple[str, str], prompt: list,
                                                     count: int) -> None:
    answer = client.completions.create(model=owner[1], prompt=prompt, max_tokens=5, temperature=0,
                                       stop=None, extra_body={"return_token_ids": True})
    assert [c.index for c in answer.choices] == list(range(count))
    assert all(c.finish_reason == "length" or c.finish_reason == "stop" for c in answer.choices)
    prompts = [(c.model_extra or {})["prompt_token_ids"] for c in answer.choices]
    if isinstance(prompt[0], list):
        assert prompts == prompt
    elif isinstance(prompt[0], int):
        assert prompts == [prompt]
    assert answer.usage is not None and answer.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert answer.usage.completion_tokens == sum(len((c.model_extra or {})["token_ids"]) + (c.finish_reason == "stop")
                                                 for c in answer.choices)


def test_lm_eval_loglikelihood_matches_forward(live_server: LiveServer, client: openai.OpenAI,
                                               owner: tuple[str, str]) -> None:
    ids = [28120, 905, 314, 260, 3575, 282]
    answer = client.completions.create(model=owner[1], prompt=ids, max_tokens=1, logprobs=1, echo=True,
                                       temperature=0)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    prompt_part = logprobs.token_logprobs[1:len(ids)]
    expected = teacher_forced(live_server, owner[0], owner[1], ids)
    assert max(abs(a - b) for a, b in zip(prompt_part, expected, strict=True)) < 1e-4
    assert logprobs.tokens is not None and len(logprobs.tokens) == len(ids) + 1
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])


def test_n_with_a_seed_repeats_and_differs(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    def three() -> list[str]:
        answer = client.completions.create(model=owner[1], prompt="Once upon", n=3, seed=7, max_tokens=12,
                                           temperature=1.0)
        return [c.text for c in answer.choices]

    first = three()
    assert len(first) == 3 and three() == first and len(set(first)) > 1


def test_stop_is_honoured_and_left_out(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    free = client.completions.create(model=owner[1], prompt="Once upon", max_tokens=20, temperature=0).choices[0].text
    assert len(free) > 4
    stop = free[2:4]
    cut = client.completions.create(model=owner[1], prompt="Once upon", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"return_token_ids": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.find(stop)] and stop not in cut.text


def test_a_greedy_stream_concatenates_to_the_answer(live_server: LiveServer, client: openai.OpenAI,
                                                    owner: tuple[str, str]) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=owner[1], messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=owner[1], messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    # The same usage, but for the prompt the stream found in the decode cache (the whole answer's, sent just before).
    streamed_usage, whole_usage = chunks[-1].usage, whole.usage
    assert streamed_usage is not None and whole_usage is not None and streamed_usage.prompt_tokens_details
    assert streamed_usage.model_dump(exclude={"prompt_tokens_details"}) == \
        whole_usage.model_dump(exclude={"prompt_tokens_details"})
    assert streamed_usage.prompt_tokens_details.cached_tokens == streamed_usage.prompt_tokens - 1
    with httpx.stream("POST", f"{live_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {owner[0]}"},
                      json={"model": owner[1], "messages": messages, "max_tokens": 4, "stream": True}) as response:
        assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]


def test_returned_ids_reproduce_the_logprobs_through_forward(live_server: LiveServer, client: openai.OpenAI,
                                                             owner: tuple[str, str]) -> None:
    answer = client.chat.completions.create(model=owner[1], messages=[{"role": "user", "content": "Count"}],
                                            max_tokens=10, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
                                            extra_body={"return_token_ids": True})
    prompt_ids = (answer.model_extra or {})["prompt_token_ids"]
    choice = answer.choices[0]
    ids = (choice.model_extra or {})["token_ids"]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    returned = [entry.logprob for entry in choice.logprobs.content]
    assert len(returned) == len(ids) > 0 and all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    forced = teacher_forced(live_server, owner[0], owner[1], prompt_ids + ids)[len(prompt_ids) - 1:]
    assert max(abs(a - b) for a, b in zip(returned, forced, strict=True)) < 1e-4


def test_the_async_client_and_the_records(live_server: LiveServer, owner: tuple[str, str]) -> None:
    async def go() -> str:
        async with openai.AsyncOpenAI(api_key=owner[0], base_url=f"{live_server.url}/v1", max_retries=0) as aclient:
            answer = await aclient.completions.create(model=owner[1], prompt="Recorded prompt", max_tokens=3)
            return answer.choices[0].text

    text = asyncio.run(go())
    run = SignalClient(api_key=owner[0], base_url=live_server.url).get_run(owner[1])
    assert text in [s["output"] for s in run.samples()]


@pytest.mark.parametrize("arguments, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"n": 17}, "n"), ({"temperature": 3}, "temperature"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": "x" * 257}, "stop"), ({"seed": 2**63}, "seed"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
    ({"extra_body": {"tool_choice": "auto"}}, "tool_choice"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"extra_body": {"response_format": {"type": "json_object"}}},
                                               "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_parameter_errors_are_400_naming_the_param(client: openai.OpenAI, owner: tuple[str, str],
                                                   arguments: dict, param: str) -> None:
    arguments = {"messages": [{"role": "user", "content": "hi"}], **arguments}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=owner[1], **arguments)
    assert error.value.status_code == 400 and error.value.param == param


def test_neutral_values_are_accepted(client: openai.OpenAI, owner: tuple[str, str]) -> None:
    answer = client.chat.completions.create(model=owner[1], messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            user="u", metadata={"a": "b"}, store=False, presence_penalty=0,
                                            logit_bias={}, tool_choice="none", response_format={"type": "text"})
    assert len(answer.choices) == 1


def test_errors(live_server: LiveServer, client: openai.OpenAI, owner: tuple[str, str]) -> None:
    other = live_server.new_user()
    foreign = SignalClient(api_key=other, base_url=live_server.url).create_run(lora_r=4).id
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model=foreign, prompt="x", max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(foreign)
    with pytest.raises(openai.NotFoundError) as snapshot:
        client.completions.create(model=f"{owner[1]}@never-saved", prompt="x", max_tokens=1)
    assert "save_weights_for_sampler" in snapshot.value.message
    bad_key = openai.OpenAI(api_key="sk-nope", base_url=f"{live_server.url}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    response = httpx.post(f"{live_server.url}/v1/embeddings", json={}, headers={"Authorization": f"Bearer {owner[0]}"})
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    big = httpx.post(f"{live_server.url}/v1/completions", content=b"x" * (2 * 1024 * 1024),
                     headers={"Authorization": f"Bearer {owner[0]}", "Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_a_snapshot_and_a_base_model_are_models_too(live_server: LiveServer, tiny_model_dir: str) -> None:
    """`{run_id}@{name}` samples a sampler snapshot (which keeps its weights while the run trains on), a catalogue
    name the base alone; /v1/models lists both beside the run."""
    key = live_server.new_user()
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, learning_rate=0.05, seed=2)
    batch = [{"input": "The sky is", "output": " blue and wide."}]
    run.forward_backward(batch=batch)
    run.optim_step()
    run.save_weights_for_sampler(name="s1")
    client = openai.OpenAI(api_key=key, base_url=f"{live_server.url}/v1", max_retries=0)
    ids = [m.id for m in client.models.list().data]
    assert {run.id, f"{run.id}@s1", "tiny-llama"} <= set(ids)
    ask: dict[str, Any] = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "extra_body": {"return_token_ids": True}}
    frozen = client.completions.create(model=f"{run.id}@s1", **ask)
    expected = run.sample(prompts=["The sky is"], max_tokens=6, temperature=0.0, snapshot="s1")
    assert frozen.choices[0].text == expected["outputs"][0]
    for _ in range(3):  # the run trains on; its snapshot does not move
        run.forward_backward(batch=batch)
        run.optim_step()
    assert client.completions.create(model=f"{run.id}@s1", **ask).choices[0].text == frozen.choices[0].text
    base = client.completions.create(model="tiny-llama", **ask)
    fresh = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4)  # LoRA B starts at zero
    assert base.choices[0].text == fresh.sample(prompts=["The sky is"], max_tokens=6, temperature=0.0)["outputs"][0]
