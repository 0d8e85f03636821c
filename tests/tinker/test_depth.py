"""The rest of issue 16's checks with the real `tinker` SDK as the client: split batches against a single batch,
pipelined operations, resume with and without the optimizer, string stops, compute_logprobs' values, and errors
raised within a bounded wait (each `.result(timeout=ERROR_WAIT_S)`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for
from tests.tinker.test_wire import TOKENS, as_list, datum

ERROR_WAIT_S = 10  # the bound on how long an error case may take to raise
PROBE = [1, 450, 2011, 310, 264, 1421, 29889, 13, 450, 4996]


def loss(client: Any, data: list[Any]) -> float:
    return float(client.forward(data, "cross_entropy").result().metrics["loss:sum"])


def step(client: Any, data: list[Any], learning_rate: float = 0.05) -> float:
    """One forward_backward + optim_step; returns the step the optimizer reports."""
    from tinker import types

    client.forward_backward(data, "cross_entropy").result()
    return float(client.optim_step(types.AdamParams(learning_rate=learning_rate)).result().metrics["optim/step"])


def batch(n: int) -> list[Any]:
    return [datum(TOKENS[: 4 + i % 5], weights=[1.0] * (3 + i % 5)) for i in range(n)]


@pytest.fixture(scope="module")
def wide_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
                live_server: LiveServer) -> Iterator[LiveServer]:
    """A second server whose max_batch_size holds the whole max_batch_size + 1 batch: the single-batch side. Its
    catalogue names no `tokenizer`, so get_info answers the runtime's tokenizer directory, the local default."""
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-wide")), tiny_model_dir,
                                           max_batch_size=live_server.settings.max_batch_size + 1))
    yield server
    server.stop()


def test_a_split_batch_trains_as_one_batch(live_server: LiveServer, service_client: Any,
                                           wide_server: LiveServer) -> None:
    """max_batch_size + 1 datums: the SDK splits them in two chunks here (chunk 2 sent first) and sends them whole to
    the wide server. Sums of the chunks' gradients are the batch's, so the next loss is the same."""
    import tinker

    n = live_server.settings.max_batch_size + 1
    wide = tinker.ServiceClient(base_url=wide_server.url, api_key="tml-" + wide_server.new_user())
    losses = []
    for client in (service_client, wide):
        training = client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=11).result()
        assert step(training, batch(n)) == 1.0
        losses.append(loss(training, [datum(PROBE, weights=[1.0] * 9)]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_get_info_names_the_tokenizer_directory_the_runtime_wrote(wide_server: LiveServer, tiny_model_dir: str) -> None:
    """By default on the local backend (no setting), tokenizer_id is a directory under the runtime's data
    directory, not the catalogue's: get_tokenizer() loads it offline and encodes as the base's own tokenizer does."""
    import tinker
    from transformers import AutoTokenizer

    client = tinker.ServiceClient(base_url=wide_server.url, api_key="tml-" + wide_server.new_user())
    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    directory = Path(cast(str, training.get_info().model_data.tokenizer_id))
    assert directory.parent == Path(wide_server.settings.data_dir) / "tokenizers"
    assert (directory / "tokenizer_config.json").is_file()
    text = "Signal trains LoRA adapters: héllo wörld"
    assert training.get_tokenizer().encode(text) == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text)
    again = client.create_lora_training_client(base_model=TINY_MODEL, rank=4).result()
    assert again.get_info().model_data.tokenizer_id == str(directory)  # written once per base, then reused


@pytest.mark.parametrize("loss_fn, inputs", [
    ("cross_entropy", {"weights": [0.0] * 3 + [1.0] * 6}),
    ("importance_sampling", {"logprobs": [-1.0] * 9, "advantages": [0.0] * 3 + [1.5, -0.5] * 3}),
])
def test_the_same_datum_gives_the_same_answer_through_signals_own_sdk(
        live_server: LiveServer, service_client: Any, loss_fn: str, inputs: dict[str, list[float]]) -> None:
    """The wire is a thin adapter over the same service: one datum on a fresh adapter (LoRA's B starts at zero, so
    both sides compute the base) gives Tinker's SDK and Signal's SDK the same logprobs and the same summed loss."""
    from rewardsignal import SignalClient

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=3).result()
    tinker_out = training.forward_backward([datum(TOKENS, **inputs)], loss_fn).result()
    run = SignalClient(api_key=live_server.new_user(), base_url=live_server.url).create_run(lora_r=4, seed=3)
    signal_out = run.forward_backward([{"model_input": TOKENS[:-1], "loss_fn_inputs": {"target_tokens": TOKENS[1:],
                                                                                       **inputs}}],
                                      loss_fn=loss_fn, reduction="sum", return_outputs=True)
    assert signal_out.outputs[0]["logprobs"] == pytest.approx(as_list(tinker_out.loss_fn_outputs[0]["logprobs"]),
                                                              rel=1e-5, abs=1e-6)
    assert signal_out.loss == pytest.approx(tinker_out.metrics["loss:sum"], rel=1e-5)
    assert signal_out.loss != 0.0


def test_a_forward_backward_and_an_optim_step_in_flight_together(service_client: Any) -> None:
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=12).result()
    data = [datum(PROBE, weights=[1.0] * 9)]
    before = loss(training, data)
    fb = training.forward_backward(data, "cross_entropy")
    optim = training.optim_step(types.AdamParams(learning_rate=0.05))  # submitted before either is awaited
    assert fb.result().metrics["loss:sum"] == pytest.approx(before, rel=1e-6)  # the pre-step loss
    assert optim.result().metrics["optim/step"] == 1.0
    assert loss(training, data) < before


def test_resume_with_and_without_the_optimizer(service_client: Any) -> None:
    """save_state after a step, then the uninterrupted run's next step against each resumed client's next step."""
    data = [datum(PROBE, weights=[1.0] * 9)]
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=13).result()
    step(training, data)
    path = training.save_state("mid").result().path
    saved = loss(training, data)
    assert step(training, data) == 2.0
    uninterrupted = loss(training, data)

    with_optimizer = service_client.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service_client.create_training_client_from_state(path).result()
    for resumed in (with_optimizer, weights_only):
        assert loss(resumed, data) == pytest.approx(saved, rel=1e-6)  # the weights at the save
    step(with_optimizer, data)
    assert loss(with_optimizer, data) == pytest.approx(uninterrupted, rel=1e-6)
    # Without the optimizer Adam starts from zero moments: its first step is a different step.
    step(weights_only, data)
    assert abs(loss(weights_only, data) - uninterrupted) > 1e-6 * abs(uninterrupted)


@pytest.fixture(scope="module")
def trained(service_client: Any) -> Any:
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=14).result()
    step(training, [datum(PROBE, weights=[1.0] * 9)])
    return training


def test_compute_logprobs_equals_the_trainers_forward(trained: Any) -> None:
    """The sampler's compute_logprobs are the forward's per-position logprobs of the same weights, shifted by one
    (position 0 has none)."""
    from tinker import types

    sampler = trained.save_weights_and_get_sampling_client().result()
    scores = sampler.compute_logprobs(types.ModelInput.from_ints(PROBE)).result()
    forward = as_list(trained.forward([datum(PROBE, weights=[1.0] * 9)], "cross_entropy").result()
                      .loss_fn_outputs[0]["logprobs"])
    assert scores[0] is None and len(scores) == len(PROBE)
    assert scores[1:] == pytest.approx(forward, abs=1e-4)


def test_a_string_stop_ends_the_sample_after_the_text(trained: Any) -> None:
    """Seeded sampling with a string stop: the tokens are the same seed's free run's up to the first prefix whose
    text holds the stop string (the stop's tokens included), and stop_reason is "stop"."""
    from tinker import types

    tokenizer = trained.get_tokenizer()
    sampler = trained.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROBE[:4])
    free = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=8, temperature=1.0, seed=5, stop=[])).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 8

    def text(k: int) -> str:
        return str(tokenizer.decode(free.tokens[:k]))

    def added(k: int) -> str:  # the text the k-th token adds
        return text(k)[len(text(k - 1)):] if text(k).startswith(text(k - 1)) else ""

    # The stop string: the first non-blank text a token from the 3rd on adds that the text before it lacks.
    stop = next(added(k) for k in range(3, 9) if added(k).strip() and added(k) not in text(k - 1))
    end = next(k for k in range(1, 9) if stop in text(k))
    assert end >= 3
    stopped = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=8, temperature=1.0, seed=5, stop=[stop])).result().sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens == free.tokens[:end]
    assert stopped.logprobs == pytest.approx(free.logprobs[:end], abs=1e-4)


def test_an_unknown_base_model_is_refused(service_client: Any) -> None:
    import tinker

    with pytest.raises(tinker.RequestFailedError) as failed:
        service_client.create_lora_training_client(base_model="no-such/model", rank=4).result(timeout=ERROR_WAIT_S)
    assert failed.value.category.value == "user" and "no-such/model" in str(failed.value)
