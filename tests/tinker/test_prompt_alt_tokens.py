"""Tinker's `prompt_alt_tokens_k` through the real `tinker==0.38.0` SDK (docs/TINKER.md): the draws' shapes and dtypes
as the SDK reads them, reproducible with a seed and the same beside other users' prompts, distributed as the
softmax of the model's logits (chi-squares with fixed seeds: they cannot flake), and its bounds as 400s naming it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import torch

from gpu_runtime.contract.sampling_settings import MAX_PROMPT_ALT_CELLS, MAX_PROMPT_ALT_TOKENS
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.test_wire import TOKENS

PROMPT = TOKENS  # 10 tokens: 9 positions of draws
K = 256


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=TINY_MODEL).result()


@pytest.fixture(scope="module")
def logits(tiny_model_dir: str) -> torch.Tensor:
    """The tiny model's logits over PROMPT, [len - 1, vocab] (row i: position i + 1), from the weights the server
    loads; the test below ties them to the server's own prompt logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()


def draw(sampler: Any, k: int, temperature: float, seed: int = 5, **extras: Any) -> Any:
    from tinker import types

    return sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, prompt_alt_tokens_k=k,
                          sampling_params=types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed),
                          **extras)


def chi_square(cells: Sequence[tuple[float, float]]) -> float:
    return sum((seen - expected) ** 2 / expected for seen, expected in cells)


def bound(dof: int) -> float:
    return dof + 6 * math.sqrt(2 * dof)  # six standard deviations past a chi-square's mean: a right sampler is inside


def test_shapes_dtypes_and_logprobs_as_the_sdk_reads_them(sampler: Any, logits: torch.Tensor) -> None:
    got = draw(sampler, 4, 1.0, include_prompt_logprobs=True, topk_prompt_logprobs=20).result()
    alt = got.prompt_alt_tokens
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    tokens, logprobs = alt.tokens.to_torch(), alt.logprobs.to_torch()
    assert list(tokens.shape) == list(logprobs.shape) == [len(PROMPT) - 1, 4]  # row i: prompt position i + 1
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits, dim=-1)
    # The local logits are the server's: its own prompt logprobs and top-20 agree with them.
    assert got.prompt_logprobs[1:] == pytest.approx([float(expected[i, PROMPT[i + 1]]) for i in range(9)], abs=1e-4)
    assert [t for t, _ in got.topk_prompt_logprobs[3]] == torch.topk(expected[2], 20).indices.tolist()
    assert logprobs.reshape(-1).tolist() == pytest.approx(expected.gather(1, tokens).reshape(-1).tolist(), abs=1e-4)
    assert got.prompt_cache_hit_tokens == 0  # every position's logits were computed, none reused


def test_draws_repeat_with_a_seed_and_beside_other_users_prompts(live_server: LiveServer, sampler: Any) -> None:
    import tinker
    from tinker import types

    first = draw(sampler, 8, 1.0, seed=21).result().prompt_alt_tokens.tokens.to_torch()
    other = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + live_server.new_user())
    theirs = other.create_sampling_client(base_model=TINY_MODEL).result()
    try:
        # Another user's prompts in flight when ours is sent: they share the runtime's decode engine and its passes.
        crowd = [theirs.sample(prompt=types.ModelInput.from_ints(PROMPT[i:] + [7 + i]), num_samples=2,
                               prompt_alt_tokens_k=3, sampling_params=types.SamplingParams(max_tokens=6, seed=i))
                 for i in range(4)]
        beside = draw(sampler, 8, 1.0, seed=21)
        for future in crowd:
            future.result()
        again = beside.result().prompt_alt_tokens.tokens.to_torch()
    finally:
        other.holder.close()
    assert torch.equal(first, again)
    assert not torch.equal(first, draw(sampler, 8, 1.0, seed=22).result().prompt_alt_tokens.tokens.to_torch())


def test_draws_at_temperature_1_follow_the_softmax(sampler: Any, logits: torch.Tensor) -> None:
    """The tiny model's next-token distribution is nearly flat over 49,152 ids, so the draws are binned by their
    place in it: u = F(t-) + v p(t) (v a fixed uniform) is uniform on (0, 1) exactly when t ~ p (the probability
    integral transform); 20 bins over 9 x 256 draws."""
    tokens = draw(sampler, K, 1.0).result().prompt_alt_tokens.tokens.to_torch()
    probs = torch.softmax(logits.double(), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    v = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = before.gather(1, tokens) + v * probs.gather(1, tokens)
    counts = torch.bincount((u * 20).long().clamp(max=19).reshape(-1), minlength=20).tolist()
    n = tokens.numel()
    assert chi_square([(c, n / 20) for c in counts]) < bound(19)
    assert len(set(tokens.reshape(-1).tolist())) > 0.9 * n  # a flat distribution: draws seldom repeat


@pytest.mark.parametrize("temperature", [0.03, 0.0])
def test_draws_at_a_low_temperature_gather_on_the_argmax(sampler: Any, logits: torch.Tensor,
                                                         temperature: float) -> None:
    tokens = draw(sampler, K, temperature).result().prompt_alt_tokens.tokens.to_torch()
    argmax = logits.argmax(dim=-1)
    if temperature == 0:
        assert torch.equal(tokens, argmax[:, None].expand_as(tokens))
        return
    probs = torch.softmax(logits / temperature, dim=-1)  # 0.5 to 1.0 on the argmax here, a few tokens after it
    statistic, dof = 0.0, 0
    for row, drawn in zip(probs, tokens):
        kept = [int(t) for t in torch.nonzero(K * row >= 5).flatten()]
        seen = [int((drawn == t).sum()) for t in kept]
        cells = [(float(s), K * float(row[t])) for s, t in zip(seen, kept)] + [(K - sum(seen), K * (1 - float(row[kept].sum())))]
        statistic += chi_square([c for c in cells if c[1] >= 5])
        dof += len([c for c in cells if c[1] >= 5]) - 1
    assert dof >= 5 and statistic < bound(dof), (statistic, dof)
    assert float((tokens == argmax[:, None]).double().mean()) > 0.6


@pytest.fixture(scope="module")
def wire(live_server: LiveServer, sampler: Any) -> Any:
    """asample posted as the SDK would, with a prompt_alt_tokens_k the SDK itself would not send."""
    headers = {"X-API-Key": "tml-" + live_server.new_user()}

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{live_server.url}/api/v1/{path}", headers=headers, json=body, timeout=60)

    session = post("create_session", {"tags": [], "display_name": "alt"}).json()["session_id"]
    created = post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                               "base_model": TINY_MODEL}).json()["sampling_session_id"]

    def asample(k: object, prompt: list[int]) -> httpx.Response:
        return post("asample", {"sampling_session_id": created, "seq_id": 0, "num_samples": 1,
                                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                                "sampling_params": {"max_tokens": 1}, "prompt_alt_tokens_k": k})

    return asample


@pytest.mark.parametrize(("k", "length"), [
    (MAX_PROMPT_ALT_TOKENS + 1, 10), (-1, 10), ("4", 10), (2.5, 10), (True, 10),
    (MAX_PROMPT_ALT_TOKENS, MAX_PROMPT_ALT_CELLS // MAX_PROMPT_ALT_TOKENS + 2),  # k x (len - 1) past the cells' bound
], ids=["over", "negative", "string", "float", "bool", "cells"])
def test_out_of_bounds_or_of_the_wrong_type_is_a_400_naming_it(wire: Any, k: object, length: int) -> None:
    answer = wire(k, [100 + i % 50 for i in range(length)])
    assert answer.status_code == 400, answer.text
    assert answer.json()["category"] == "user" and "prompt_alt_tokens_k" in answer.json()["detail"]


def test_over_the_bound_through_the_sdk_is_a_user_error_naming_it(sampler: Any) -> None:
    import tinker

    with pytest.raises(tinker.BadRequestError) as caught:
        draw(sampler, MAX_PROMPT_ALT_TOKENS + 1, 1.0).result()
    assert "prompt_alt_tokens_k" in str(caught.value)
