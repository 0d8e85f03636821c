"""Tinker's SDK, unmodified, trains and samples against Signal's /api/v1 (docs/TINKER.md)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from typing import Any

import httpx
import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.conftest import CONTEXT_LENGTH

TOKENS = [1, 450, 2011, 310, 264, 1421, 29889, 13, 450, 4996]  # arbitrary ids within the tiny vocabulary


def datum(tokens: list[int], **inputs: list[float]) -> Any:
    """Tinker's datum: position i of model_input predicts target_tokens[i] (already shifted)."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})  # type: ignore[dict-item]  # Datum converts lists to TensorData


def as_list(tensor: Any) -> list[float]:
    return [float(v) for v in tensor.tolist()]


@pytest.fixture(scope="module")
def training(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=3).result()


def test_cross_entropy_step_and_sampling(service_client: Any, training: Any, tiny_model_dir: str) -> None:
    from tinker import types

    info = training.get_info()
    assert (info.model_data.model_name, info.model_data.tokenizer_id, info.lora_rank) == (TINY_MODEL, tiny_model_dir, 8)
    tokenizer = training.get_tokenizer()  # from get_info's tokenizer_id: the catalogue's local directory, offline
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"

    weights = [1.0] * 4 + [0.5] * 5
    out = training.forward_backward([datum(TOKENS, weights=weights)], "cross_entropy").result()
    logprobs = as_list(out.loss_fn_outputs[0]["logprobs"])
    assert len(logprobs) == len(TOKENS) - 1 and all(lp < 0 for lp in logprobs)
    # Tinker's losses are sums: loss:sum == −Σ w·logprob, no normaliser.
    assert out.metrics["loss:sum"] == pytest.approx(-sum(w * lp for w, lp in zip(weights, logprobs)), rel=1e-5)
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["optim/step"] == 1.0

    # Ephemeral sampler (save_weights_for_sampler with a sampling_session_seq_id), two samples with logprobs.
    sampler = training.save_weights_and_get_sampling_client().result()
    result = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    assert len(result.sequences) == 2
    for sequence in result.sequences:
        assert 1 <= len(sequence.tokens) <= 5 and len(sequence.logprobs) == len(sequence.tokens)
        assert all(lp <= 0 for lp in sequence.logprobs)
        assert sequence.stop_reason in ("stop", "length")

    # A named sampler checkpoint, then a sampling client from its path; prompt logprobs (NaN → None at 0).
    path = training.save_weights_for_sampler("first").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/first"
    named = service_client.create_sampling_client(model_path=path).result()
    scored = named.sample(prompt=types.ModelInput.from_ints(TOKENS[:5]), num_samples=1, include_prompt_logprobs=True,
                          sampling_params=types.SamplingParams(max_tokens=1)).result()
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == 5
    assert all(lp is not None and lp < 0 for lp in scored.prompt_logprobs[1:])


def ratio_loss(loss_fn: str, logprobs: list[float], sampled: list[float], advantages: list[float]) -> float:
    """Tinker's formulas (research note §9), summed over positions."""
    ratios = [math.exp(lp - q) for lp, q in zip(logprobs, sampled)]
    if loss_fn == "importance_sampling":
        return -sum(r * a for r, a in zip(ratios, advantages))
    return -sum(min(r * a, min(max(r, 0.8), 1.2) * a) for r, a in zip(ratios, advantages))  # ppo, clip 0.8/1.2


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_losses_through_the_wire(training: Any, loss_fn: str) -> None:
    tokens = TOKENS[:8]
    sampled = [-2.0, -1.5, -3.0, -2.5, -1.0, -2.0, -4.0]
    advantages = [0.0, 0.0, 1.0, -0.5, 2.0, 1.0, 0.0]  # no weights: zero advantages mask (rl_loop pads with them)
    out = training.forward_backward([datum(tokens, logprobs=sampled, advantages=advantages)], loss_fn).result()
    logprobs = as_list(out.loss_fn_outputs[0]["logprobs"])
    assert out.metrics["loss:sum"] == pytest.approx(ratio_loss(loss_fn, logprobs, sampled, advantages), rel=1e-4)


def test_stops_and_compute_logprobs(training: Any) -> None:
    from tinker import types

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    free = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]  # []: EOS does not stop either
    assert free.stop_reason == "length" and len(free.tokens) == 6
    stop_id = free.tokens[2]
    stopped = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[stop_id])).result().sequences[0]
    # Greedy, so the same tokens; the stop token is included and ends the sequence at its first occurrence.
    first = free.tokens.index(stop_id)
    assert stopped.stop_reason == "stop" and stopped.tokens == free.tokens[:first + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[:first + 1], abs=1e-4)
    # max_tokens null: the room the prompt leaves in the catalogue's context window.
    filled = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=None, temperature=0.0, stop=[])).result().sequences[0]
    assert len(filled.tokens) == CONTEXT_LENGTH - 4 and filled.stop_reason == "length"
    scores = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert scores[0] is None and len(scores) == len(TOKENS) and all(s is not None and s < 0 for s in scores[1:])


def test_pipelined_and_split_batches(live_server: LiveServer, training: Any) -> None:
    """A batch over fwdbwd_max_chunk_len (max_batch_size) goes as chunks 2..k first, then chunk 1 (§14): each
    takes its number from seq_id, nothing waits at submit, and the outputs come back in datum order."""
    from tinker import types

    n = live_server.settings.max_batch_size + 1
    data = [datum(TOKENS[: 4 + i % 5], weights=[1.0] * (3 + i % 5)) for i in range(n)]
    forward = training.forward(data, "cross_entropy")
    fb = training.forward_backward(data, "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-3))
    before, after = forward.result(), fb.result()
    assert len(after.loss_fn_outputs) == n
    assert after.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)  # the pre-step loss
    assert [len(o["logprobs"].tolist()) for o in after.loss_fn_outputs] == [3 + i % 5 for i in range(n)]
    assert step.result().metrics["optim/step"] >= 2.0


def test_save_state_and_resume(service_client: Any, training: Any) -> None:
    from tinker import types

    path = training.save_state("resume").result().path
    assert path == f"tinker://{training.model_id}/weights/resume"
    probe = [datum(TOKENS, weights=[1.0] * 9)]
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id.endswith(":train:1")
    a = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    b = resumed.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    assert b == pytest.approx(a, rel=1e-5)
    with pytest.raises(Exception, match="exists"):
        training.save_state("resume").result()
    with pytest.warns(FutureWarning):  # the deprecated in-place load: a body with model_id and seq_id
        training.load_state(path).result()
    assert training.forward(probe, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(a, rel=1e-5)
    resumed.forward_backward(probe, "cross_entropy").result()
    assert resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim/step"] >= 1.0


def test_save_state_with_overwrite_replaces_the_checkpoint(service_client: Any) -> None:
    """An existing name is refused unless overwrite=True, which replaces it: resuming it gives the later weights."""
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=4).result()
    probe = [datum(TOKENS, weights=[1.0] * 9)]
    path = training.save_state("again").result().path
    training.forward_backward(probe, "cross_entropy").result()
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["optim/step"] == 1.0
    with pytest.raises(Exception, match="exists"):
        training.save_state("again").result()
    assert training.save_state("again", overwrite=True).result().path == path
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    now = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    assert resumed.forward(probe, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(now, rel=1e-5)


def test_bad_key_is_refused(live_server: LiveServer) -> None:
    import tinker

    client = tinker.ServiceClient(base_url=live_server.url, api_key="tml-sk-not-a-real-key")
    with pytest.raises(tinker.AuthenticationError):
        client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()


def test_a_bad_datum_fails_the_future_with_the_user_category(training: Any) -> None:
    import tinker

    bad = datum([1, 2, 10**8], weights=[1.0, 1.0])  # a token id outside the vocabulary
    # Within 10 s: the refused operations before it (an existing name in test_save_state_and_resume) released
    # their numbers, so it never waited for them.
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward([bad], "cross_entropy").result(timeout=10)
    assert failed.value.category.value == "user"


def test_cookie_only_request_is_unauthenticated(live_server: LiveServer) -> None:
    from tests.web.conftest import sign_in

    visitor = sign_in(live_server)  # a real dashboard session cookie and its CSRF token
    try:
        answer = visitor.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
        assert answer.status_code == 401 and "API key" in answer.json()["detail"]
        assert answer.headers["content-type"] == "application/json"
        assert int(answer.headers["content-length"]) == len(answer.content)
    finally:
        visitor.client.close()


def test_unknown_endpoint_and_future(live_server: LiveServer, tinker_key: str) -> None:
    headers = {"X-API-Key": tinker_key}
    unknown = httpx.post(f"{live_server.url}/api/v1/copy_weights", json={}, headers=headers)  # one Signal lacks
    assert unknown.status_code == 404 and "copy_weights" in unknown.json()["detail"]
    missing = httpx.post(f"{live_server.url}/api/v1/retrieve_future", json={"request_id": "nope"}, headers=headers)
    assert missing.status_code == 404 and missing.json()["detail"]
    garbage = httpx.post(f"{live_server.url}/api/v1/forward_backward", content=b"\xff\x00garbage",
                         headers={**headers, "Content-Type": "application/x-protobuf"})
    assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["detail"]


def test_server_imports_neither_torch_nor_tinker(tiny_model_dir: str, tmp_path: Any) -> None:
    """A fresh interpreter: create_app, then a session, a model and one forward_backward over /api/v1 in process."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        import httpx
        from tests.helpers.live_server import settings_for, LiveServer
        from app.server import create_app
        settings = settings_for(__import__("pathlib").Path({str(tmp_path)!r}), {tiny_model_dir!r})
        live = LiveServer.start(settings)
        secret = "tml-" + live.new_user()
        h = {{"X-API-Key": secret}}
        post = lambda path, **kw: httpx.post(live.url + "/api/v1/" + path, headers={{**h, **kw.pop("headers", {{}})}},
                                             timeout=120, **kw)
        session = post("create_session", json={{"tags": []}}).json()["session_id"]
        rid = post("create_model", json={{"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama",
                                          "lora_config": {{"rank": 4}}}}).json()["request_id"]
        while post("retrieve_future", json={{"request_id": rid}}).json().get("type") == "try_again":
            pass
        from app.tinker import proto
        pb = proto.pb()
        req = pb.ForwardBackwardRequest(model_id=session + ":train:0", seq_id=1, loss_fn="cross_entropy")
        d = req.data.add()
        d.model_input.add().encoded_text.tokens = proto._bytes("i", [1, 2, 3])
        d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=proto._bytes("q", [2, 3, 4]), dtype=pb.DTYPE_INT64))
        d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=proto._bytes("f", [1, 1, 1]), dtype=pb.DTYPE_FLOAT32))
        rid = post("forward_backward", content=req.SerializeToString(),
                   headers={{"Content-Type": "application/x-protobuf"}}).json()["request_id"]
        while True:
            answer = post("retrieve_future", json={{"request_id": rid}}, headers={{"Accept": "application/x-protobuf"}})
            if "protobuf" in answer.headers["content-type"]:
                break
            assert answer.json().get("type") == "try_again", answer.text
        out = pb.ForwardBackwardOutput.FromString(answer.content)
        assert out.metrics["loss:sum"] > 0
        live.stop()
        print("torch" in sys.modules, "tinker" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_rest_client_lists_and_deletes_checkpoints(live_server: LiveServer, tinker_key: str, training: Any) -> None:
    import tinker

    rest = tinker.RestClient(base_url=live_server.url, api_key=tinker_key)
    names = {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    assert TINY_MODEL in names
    training.save_weights_for_sampler("doomed").result()
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed["sampler_weights/doomed"].checkpoint_type == "sampler"
    assert listed["sampler_weights/doomed"].tinker_path == f"tinker://{training.model_id}/sampler_weights/doomed"
    run = rest.get_training_run(training.model_id).result()
    assert run.training_run_id == training.model_id and run.lora_rank == 8 and run.is_lora
    assert training.model_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    info = rest.get_weights_info_by_tinker_path(listed["sampler_weights/doomed"].tinker_path).result()
    assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (
        TINY_MODEL, 8, True, True, True)  # the SDK's defaults: all three switches
    rest.delete_checkpoint(training.model_id, "sampler_weights/doomed").result()
    after = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "sampler_weights/doomed" not in after and "sampler_weights/first" in after


def test_a_key_revoked_by_its_tinker_form_is_refused(live_server: LiveServer) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import tinker

    from app.cli import _keys_revoke
    from app.db import Database
    from app.security import display_prefix

    email = "revoked-tinker@example.com"
    secret = live_server.new_user(email)
    client = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + secret)
    client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()  # the key works

    async def revoke() -> int:
        db = Database(live_server.settings.resolved_database_url)
        try:  # `signal keys revoke tml-sk-…` names the key by its Tinker form's prefix
            return await _keys_revoke(db, email, "tml-" + display_prefix(secret))
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(asyncio.run, revoke()).result() == 0
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + secret).create_lora_training_client(
            base_model=TINY_MODEL, rank=4).result(timeout=10)


def test_lora_switches_reach_the_run(live_server: LiveServer) -> None:
    """train_attn/train_mlp/train_unembed (all true in the SDK) become the run's LoRA targets: attention only has
    fewer trainable parameters than the defaults, and Signal's own API shows the same runs."""
    import tinker

    secret = live_server.new_user()
    client = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + secret)
    client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    client.create_lora_training_client(base_model=TINY_MODEL, rank=4, train_mlp=False, train_unembed=False).result()
    runs = live_server.graphql("{ runs { trainableParams loraR loraAlpha loraTargetModules } }", key=secret)["data"]["runs"]
    attention, default = sorted(runs, key=lambda run: run["trainableParams"])
    assert attention["trainableParams"] < default["trainableParams"]
    assert {(run["loraR"], run["loraAlpha"]) for run in runs} == {(4, 32.0)}  # Tinker's fixed alpha, not 2r
    assert "lm_head" in default["loraTargetModules"] and "gate_proj" in default["loraTargetModules"]
    assert not {"lm_head", "gate_proj", "up_proj", "down_proj"} & set(attention["loraTargetModules"])


def test_an_unknown_model_is_refused(service_client: Any) -> None:
    import tinker

    with pytest.raises(tinker.RequestFailedError) as failed:
        service_client.create_training_client_from_state("tinker://nobody:train:0/weights/final").result(timeout=10)
    assert failed.value.category.value == "user" and "not found" in str(failed.value)


def test_the_sessions_name_and_metadata_show_on_the_runs_page(live_server: LiveServer) -> None:
    import tinker

    from tests.web.conftest import sign_in

    email = "cookbook-user@example.com"
    secret = live_server.new_user(email)
    client = tinker.ServiceClient(user_metadata={"recipe": "sl_loop", "git_rev": "<b>abc123</b>"},
                                  display_name="my sft", base_url=live_server.url, api_key="tml-" + secret)
    model_id = client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result().model_id
    run_id = live_server.graphql("{ runs { id } }", key=secret)["data"]["runs"][0]["id"]
    visitor = sign_in(live_server, email)
    try:
        html = visitor.client.get(f"/runs/{run_id}").text
    finally:
        visitor.client.close()
    assert "my sft" in html and model_id in html and "sl_loop" in html
    assert "&lt;b&gt;abc123&lt;/b&gt;" in html  # escaped: metadata is the client's text


def test_signals_own_mutations_on_a_tinker_run_are_refused(live_server: LiveServer) -> None:
    import tinker

    from tests.helpers.live_server import error_code

    secret = live_server.new_user()
    client = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + secret)
    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    run_id = live_server.graphql("{ runs { id } }", key=secret)["data"]["runs"][0]["id"]
    refused = live_server.graphql("mutation($id: ID!) { optimStep(runId: $id) { step } }", {"id": run_id},
                                  key=secret)
    assert error_code(refused) == "FAILED_PRECONDITION"
    assert training.model_id.split(":")[0] in refused["errors"][0]["message"]
    training.forward_backward([datum(TOKENS, weights=[1.0] * 9)], "cross_entropy").result()  # Tinker's own go on
    metrics = training.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result().metrics
    assert metrics is not None and metrics["optim/step"] == 1.0


def test_a_sampler_keeps_its_snapshot_while_training_goes_on(service_client: Any, training: Any) -> None:
    """save_weights_for_sampler freezes the weights at its seq_id (a sampler snapshot): greedy tokens and logprobs
    from it stay the same after two more steps, while a new sampler sees the trained weights."""
    from tinker import types

    prompt, greedy = types.ModelInput.from_ints(TOKENS[:4]), types.SamplingParams(max_tokens=6, temperature=0.0,
                                                                                  stop=[])
    frozen = training.save_weights_and_get_sampling_client().result()
    before = frozen.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    for _ in range(2):
        training.forward_backward([datum(TOKENS, weights=[1.0] * 9)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    after = frozen.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert after.tokens == before.tokens and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    fresh = training.save_weights_and_get_sampling_client().result()
    trained = fresh.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert max(abs(a - b) for a, b in zip(trained.logprobs, before.logprobs)) > 1e-4 or trained.tokens != before.tokens
    base = service_client.create_sampling_client(base_model=TINY_MODEL).result()  # the base alone
    assert len(base.sample(prompt=prompt, num_samples=2, sampling_params=greedy).result().sequences) == 2
