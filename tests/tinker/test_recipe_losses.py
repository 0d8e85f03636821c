"""The cookbook's newer losses through the real tinker SDK (docs/LOSSES.md): stable_reinforce (a sample with
record_stability_info keeps each sequence's logprobs, a datum's provenance names it, an unknown or another user's
sequence is a user error), and gspo."""

from __future__ import annotations

import math
from typing import Any

import pytest

from app.tinker.stability import StabilityStore
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.test_wire import TOKENS, as_list

PROMPT = TOKENS[:4]


@pytest.fixture(scope="module")
def training(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=5).result()


def sampled(training: Any, record: bool, num_samples: int = 2) -> list[Any]:
    from tinker import types

    sampler = training.save_weights_and_get_sampling_client(record_stability_info=record).result()
    result = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=num_samples,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
    return list(result.sequences)


def rl_datum(sequence: Any, advantage: float, given_logprobs: float = 0.0, sequence_id: str | None = None,
             **extra: list[float]) -> Any:
    """rl_loop's datum (recipes/rl_loop.py): the prompt padded with target 0 and advantage 0, then the sampled tokens;
    its provenance as rl_loop writes it. The datum's own logprobs are `given_logprobs` everywhere."""
    from tinker import types

    tokens, ob = list(sequence.tokens), len(PROMPT) - 1
    the_id = sequence_id or sequence.sequence_id
    inputs: dict[str, Any] = {  # lists: Datum converts them to TensorData
        "target_tokens": [0] * ob + tokens, "logprobs": [given_logprobs] * (ob + len(tokens)),
        "advantages": [0.0] * ob + [advantage] * len(tokens), **extra}
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + tokens[:-1]), loss_fn_inputs=inputs)
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=the_id, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=the_id, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=the_id, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=the_id, length=len(tokens))])


def test_stable_reinforce_weighs_reinforce_by_the_recorded_truncated_ratio(training: Any) -> None:
    sequences = sampled(training, record=True)
    advantages = [1.0, -0.5]
    # The datums' own logprobs (0.0) are wrong on purpose: the recorded ones must be used instead.
    datums = [rl_datum(s, a) for s, a in zip(sequences, advantages)]
    out = training.forward_backward(datums, "stable_reinforce", loss_fn_config={"clip_high_threshold": 1.5}).result()
    expected, ratios = 0.0, []
    for sequence, advantage, output in zip(sequences, advantages, out.loss_fn_outputs):
        learner = as_list(output["logprobs"])[len(PROMPT) - 1:]
        for lp, q in zip(learner, sequence.logprobs):
            ratios.append(math.exp(lp - q))
            expected -= min(ratios[-1], 1.5) * lp * advantage
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    # The same weights sampled and trained: the ratio is 1 up to the sampler's and the pass's numerics.
    assert out.metrics["stability/ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-4)
    assert out.metrics["stability/ratio:max"] == pytest.approx(max(ratios), rel=1e-4)
    assert out.metrics["stability/truncated:mean"] == sum(r > 1.5 for r in ratios) / len(ratios)
    assert out.metrics["stability/ratio:max"] < 1.01


def test_gspo_clips_the_length_normalised_sequence_ratio(training: Any) -> None:
    (sequence,) = sampled(training, record=False, num_samples=1)
    ob, n = len(PROMPT) - 1, len(sequence.tokens)
    shifted = [q - 0.2 for q in sequence.logprobs]  # the sampler 0.2 nats less likely per token: s = e^0.2 = 1.22
    from tinker import types

    inputs: dict[str, Any] = {"target_tokens": [0] * ob + list(sequence.tokens), "logprobs": [0.0] * ob + shifted,
                              "advantages": [0.0] * ob + [2.0] * n, "sequence_ratio_mask": [0.0] * ob + [1.0] * n}
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + list(sequence.tokens)[:-1]),
                        loss_fn_inputs=inputs)
    out = training.forward_backward([datum], "gspo").result()
    learner = as_list(out.loss_fn_outputs[0]["logprobs"])[ob:]
    s = math.exp(sum(lp - q for lp, q in zip(learner, shifted)) / n)
    # -min(s A, clip(s) A) for the sequence: s ≈ 1.22 is clipped at GSPO's 1 + 4e-4.
    assert out.metrics["loss:sum"] == pytest.approx(-min(s * 2.0, min(max(s, 1 - 3e-4), 1 + 4e-4) * 2.0), rel=1e-4)


def test_other_losses_ignore_provenance_sampled_without_the_record(training: Any) -> None:
    """The cookbook's rl/train.py attaches provenance to every RL datum, whatever its loss and sampler."""
    (sequence,) = sampled(training, record=False, num_samples=1)
    out = training.forward([rl_datum(sequence, 1.0, sequence_id="never-recorded:0")], "importance_sampling").result()
    learner = as_list(out.loss_fn_outputs[0]["logprobs"])[len(PROMPT) - 1:]
    # The datum's own logprobs (0.0 everywhere) are the sampler's: nothing replaced them.
    assert out.metrics["loss:sum"] == pytest.approx(-sum(math.exp(lp) for lp in learner), rel=1e-4)


@pytest.mark.parametrize("case", ["unknown", "not_recorded", "another_user"])
def test_a_sequence_the_user_did_not_record_is_a_user_error_naming_the_field(
        live_server: LiveServer, training: Any, case: str) -> None:
    import tinker

    if case == "another_user":
        other = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + live_server.new_user())
        theirs = other.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=5).result()
        sequence = sampled(theirs, record=True, num_samples=1)[0]
    else:
        sequence = sampled(training, record=case == "unknown", num_samples=1)[0]
    the_id = "no-such-request:0" if case == "unknown" else None
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward([rl_datum(sequence, 1.0, sequence_id=the_id)], "stable_reinforce").result(timeout=60)
    assert failed.value.category.value == "user"
    assert "data[0].loss_fn_input_spans[1].sequence_id" in str(failed.value)


def test_the_record_expires_and_stays_within_its_token_bound() -> None:
    expired = StabilityStore(ttl_s=0.0)
    expired.record("u", "r:0", [1, 2], [-1.0, -2.0], "tinker://m/sampler_weights/a")
    assert expired.get("u", "r:0") is None
    bounded = StabilityStore(ttl_s=60.0, max_tokens=5)
    bounded.record("u", "r:0", [1, 2, 3], [-1.0] * 3, "v1")
    bounded.record("u", "r:1", [4, 5, 6], [-1.0] * 3, "v1")  # 6 tokens > 5: the oldest goes
    assert bounded.get("u", "r:0") is None and bounded.get("u", "r:1") is not None
    assert bounded.get("someone-else", "r:1") is None





