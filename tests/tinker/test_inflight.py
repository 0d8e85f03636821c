"""`kind: "inflight"` samplers (Tinker's SamplingClientKind): a sampler that follows its training model's latest
weights, where a snapshot stays frozen (docs/TINKER.md)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.test_wire import TOKENS, datum


def greedy(sampler: Any) -> Any:
    from tinker import types

    return sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]


def test_an_inflight_sampler_follows_each_optim_step(service_client: Any) -> None:
    """After each optim_step the inflight sampler's greedy logprobs move, and equal a snapshot's taken at that step;
    an inflight sampler made earlier and one made later agree."""
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=8, seed=5).result()
    inflight = training.save_weights_and_get_sampling_client(kind="inflight").result()
    previous = greedy(inflight)
    assert previous.logprobs == pytest.approx(greedy(training.save_weights_and_get_sampling_client().result()).logprobs,
                                              abs=1e-4)
    for _ in range(2):
        training.forward_backward([datum(TOKENS, weights=[1.0] * 9)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
        now = greedy(inflight)
        assert now.tokens != previous.tokens or max(abs(a - b) for a, b in zip(now.logprobs, previous.logprobs)) > 1e-4
        snapshot = greedy(training.save_weights_and_get_sampling_client().result())
        assert now.tokens == snapshot.tokens and now.logprobs == pytest.approx(snapshot.logprobs, abs=1e-4)
        previous = now
    later = greedy(training.save_weights_and_get_sampling_client(kind="inflight").result())
    assert later.tokens == previous.tokens and later.logprobs == pytest.approx(previous.logprobs, abs=1e-4)


@pytest.mark.parametrize("body", [{"kind": "frozen", "sampling_session_seq_id": 90},
                                  {"kind": "inflight", "path": "named"}], ids=["unknown-kind", "named-inflight"])
def test_a_bad_kind_is_a_400_naming_it(live_server: LiveServer, tinker_key: str, service_client: Any,
                                       body: dict[str, object]) -> None:
    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    answer = httpx.post(f"{live_server.url}/api/v1/save_weights_for_sampler", headers={"X-API-Key": tinker_key},
                        json={"model_id": training.model_id, "seq_id": 1, "type": "save_weights_for_sampler", **body},
                        timeout=60)
    assert answer.status_code == 400
    assert answer.json()["category"] == "user" and "kind" in answer.json()["detail"]
