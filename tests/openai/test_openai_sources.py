"""/v1 on every source, with the official `openai` package as the client on a live server with the tiny model:
Tinker sampler paths (made by the real `tinker` SDK) name the snapshot `{run_id}@{name}` names, owners only; requests
on snapshots and base models are kept in their owner's sample history and counted; requests from two users at once
are all answered, each with its own content."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import openai
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("TINKER_TELEMETRY", "0")

BASE_SAMPLES = "query { baseSamples { baseModel prompt output params } }"
COMPUTE = "query($id: ID!) { run(id: $id) { computeSeconds } }"
TOKENS = [1, 450, 2011, 310, 264, 1421, 29889, 13, 450, 4996]  # arbitrary ids within the tiny vocabulary


def v1(live_server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{live_server.url}/v1", max_retries=0, timeout=300)


def scored(client: openai.OpenAI, model: str) -> tuple[list[int], list[float]]:
    """A greedy completion's ids and the prompt's logprobs: what tells two weights apart."""
    answer = client.completions.create(model=model, prompt=TOKENS[:6], max_tokens=4, temperature=0, logprobs=0,
                                       echo=True, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return (choice.model_extra or {})["token_ids"], [lp for lp in choice.logprobs.token_logprobs[1:6]]


@pytest.fixture(scope="module")
def tinker_made(live_server: LiveServer) -> dict[str, Any]:
    """A user whose run was made, trained one step and snapshotted by the real Tinker SDK: its key, the run id and
    the sampler path save_weights_for_sampler returned."""
    import tinker
    from tinker import types

    key = live_server.new_user()
    service = tinker.ServiceClient(base_url=live_server.url, api_key=f"tml-{key}")
    training = service.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})  # type: ignore[dict-item]  # Datum converts lists to TensorData
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("s1").result().path
    state = training.save_state("w1").result().path
    runs = SignalClient(api_key=key, base_url=live_server.url).list_runs()
    assert len(runs) == 1
    return {"key": key, "run": runs[0].id, "path": path, "state": state, "model_id": training.model_id}


def test_a_tinker_sampler_path_names_the_snapshot(live_server: LiveServer, tinker_made: dict[str, Any]) -> None:
    client = v1(live_server, tinker_made["key"])
    path, run_id = tinker_made["path"], tinker_made["run"]
    assert path == f"tinker://{tinker_made['model_id']}/sampler_weights/s1"
    assert client.models.retrieve(path).id == path
    assert {path, f"{run_id}@s1", run_id} <= {model.id for model in client.models.list().data}
    by_path, by_name, base = scored(client, path), scored(client, f"{run_id}@s1"), scored(client, TINY_MODEL)
    assert by_path == by_name
    assert max(abs(a - b) for a, b in zip(by_path[1], base[1], strict=True)) > 1e-4  # trained: not the base
    chat = client.chat.completions.create(model=path, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0)
    assert chat.model == path and len(chat.choices) == 1


def test_a_tinker_path_is_its_owners_only(live_server: LiveServer, tinker_made: dict[str, Any]) -> None:
    path = tinker_made["path"]
    stranger = v1(live_server, live_server.new_user())
    with pytest.raises(openai.NotFoundError) as foreign:
        stranger.completions.create(model=path, prompt="x", max_tokens=1)
    assert foreign.value.code == "model_not_found" and foreign.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        stranger.models.retrieve(path)
    owner = v1(live_server, tinker_made["key"])
    with pytest.raises(openai.NotFoundError) as unsaved:
        owner.completions.create(model=path.replace("/s1", "/never-saved"), prompt="x", max_tokens=1)
    assert "save_weights_for_sampler" in unsaved.value.message
    with pytest.raises(openai.NotFoundError) as training_checkpoint:
        owner.completions.create(model=tinker_made["state"], prompt="x", max_tokens=1)
    assert "sampler_weights" in training_checkpoint.value.message
    for malformed in ("tinker://", f"tinker://{tinker_made['model_id']}/sampler_weights", "tinker://a/b/c/d"):
        with pytest.raises(openai.NotFoundError):
            owner.completions.create(model=malformed, prompt="x", max_tokens=1)


def base_samples(live_server: LiveServer, key: str) -> list[dict[str, Any]]:
    body = live_server.graphql(BASE_SAMPLES, key=key)
    assert "errors" not in body, body
    return list(body["data"]["baseSamples"])


def compute_seconds(live_server: LiveServer, key: str, run_id: str) -> float:
    body = live_server.graphql(COMPUTE, {"id": run_id}, key=key)
    assert "errors" not in body, body
    return float(body["data"]["run"]["computeSeconds"])


def chat(client: openai.OpenAI, model: str, content: str, **extra: Any) -> tuple[str, list[int]]:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=4, temperature=0, extra_body={"return_token_ids": True},
                                            **extra)
    return answer.choices[0].message.content or "", (answer.model_extra or {})["prompt_token_ids"]


def test_snapshot_and_base_requests_are_recorded_for_their_owner(live_server: LiveServer,
                                                                 tinker_made: dict[str, Any]) -> None:
    key, other = live_server.new_user(), live_server.new_user()
    signal = SignalClient(api_key=key, base_url=live_server.url)
    run = signal.create_run(lora_r=4)
    run.save_weights_for_sampler(name="rec")
    client = v1(live_server, key)
    before = compute_seconds(live_server, key, run.id)

    text, prompt_ids = chat(client, f"{run.id}@rec", "A snapshot request")
    rows = run.samples()
    assert len(rows) == 1 and rows[0]["prompt"] == json.dumps(prompt_ids)
    assert rows[0]["output"].startswith(text) and rows[0]["params"]["snapshot"] == "rec"
    assert compute_seconds(live_server, key, run.id) > before  # billed to the run, like sample

    chat(client, f"{run.id}@rec", "Not kept", store=False)  # OpenAI's store: false keeps nothing
    assert len(run.samples()) == 1

    text, prompt_ids = chat(client, TINY_MODEL, "A base request")
    kept = base_samples(live_server, key)
    assert [(r["baseModel"], r["prompt"]) for r in kept] == [(TINY_MODEL, json.dumps(prompt_ids))]
    assert kept[0]["output"].startswith(text)
    assert len(run.samples()) == 1  # the base request is in the user's history, not the run's
    assert base_samples(live_server, other) == []
    with pytest.raises(openai.NotFoundError):
        v1(live_server, other).chat.completions.create(model=f"{run.id}@rec", messages=[{"role": "user",
                                                                                         "content": "x"}])

    # A Tinker path's request goes to the history of the run behind it (newest first).
    _, prompt_ids = chat(v1(live_server, tinker_made["key"]), tinker_made["path"], "Through the Tinker path")
    newest = SignalClient(api_key=tinker_made["key"], base_url=live_server.url).get_run(tinker_made["run"]).samples()[0]
    assert (newest["prompt"], newest["params"]["snapshot"]) == (json.dumps(prompt_ids), "s1")


def test_requests_from_two_users_at_once_are_each_answered_with_their_own(live_server: LiveServer) -> None:
    """Six requests in flight together (two users; a run's current weights, a snapshot, a base model): every one
    answered, each with the answer it gets alone (its own prompt ids, its own greedy tokens)."""
    asks: list[tuple[openai.OpenAI, str, str]] = []
    for tag in ("first", "second"):
        key = live_server.new_user()
        run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, seed=3)
        run.save_weights_for_sampler(name="snap")
        client = v1(live_server, key)
        asks += [(client, run.id, f"{tag} user, current weights"), (client, f"{run.id}@snap", f"{tag} user, snapshot"),
                 (client, TINY_MODEL, f"{tag} user, the base")]

    def ask(job: tuple[openai.OpenAI, str, str]) -> tuple[list[int], list[int], str]:
        client, model, content = job
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        choice = answer.choices[0]
        return (answer.model_extra or {})["prompt_token_ids"], (choice.model_extra or {})["token_ids"], answer.model

    alone = [ask(job) for job in asks]
    assert len({tuple(prompt) for prompt, _, _ in alone}) == len(asks)  # six different prompts
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(ask, job) for job in asks]
        done, pending = wait(futures, timeout=300)
        assert not pending, f"{len(pending)} of {len(asks)} requests unanswered"
    assert [future.result() for future in futures] == alone
