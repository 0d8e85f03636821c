"""A prompt's alternative tokens (Tinker's prompt_alt_tokens): k draws per prompt position, taken in the decode
engine's prefill (gpu_runtime/compute/decode/sampler.py:prompt_draws). Their distribution against a forward's softmax
(a chi-square with fixed seeds, so it cannot flake, and a wrong distribution that the same bound refuses), their
logprobs, and their independence of chunking, batch neighbours and the prefix cache."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gpu_runtime.compute.decode.engine import DecodeEngine, DecodeSettings
from gpu_runtime.compute.decode.sampler import prompt_draws
from gpu_runtime.compute.decode.slot_cache import SlotCache
from gpu_runtime.contract import RuntimeOptions, Sample
from gpu_runtime.contract.sampling_settings import MAX_PROMPT_ALT_CELLS, MAX_PROMPT_ALT_TOKENS
from gpu_runtime.errors import BadInput
from tests.gpu_runtime.test_decode_engine import CountSyncs, _prompt, _run, decode_text
from tests.gpu_runtime.test_decode_engine import llama as llama  # noqa: F401 (the module's tiny model fixture)

K = 256
ALT = DecodeSettings(max_tokens=2, temperature=1.0, seed=77, prompt_alt_k=K)


def _engine(model: Any, prefill_tokens: int = 64) -> DecodeEngine:
    return DecodeEngine(model, SlotCache(model.config, 160, slots=16), prefill_tokens=prefill_tokens,
                        decode=decode_text)


@torch.no_grad()
def _forward_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution over prompt position i + 1."""
    return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def _chi_square(draws: list[list[int]], logprobs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over every row (bins: tokens expecting 5 or more draws, and the rest as one), and its
    degrees of freedom."""
    statistic, dof = 0.0, 0
    for row, drawn in zip(logprobs.exp().tolist(), draws):
        n = len(drawn)
        counts: dict[int, int] = {}
        for t in drawn:
            counts[t] = counts.get(t, 0) + 1
        kept = [t for t, p in enumerate(row) if n * p >= 5]
        rest_p = 1.0 - sum(row[t] for t in kept)
        cells = [(counts.get(t, 0), n * row[t]) for t in kept]
        if n * rest_p >= 5:
            cells.append((n - sum(counts.get(t, 0) for t in kept), n * rest_p))
        statistic += sum((seen - expected) ** 2 / expected for seen, expected in cells)
        dof += len(cells) - 1
    return statistic, dof


def _bound(dof: int) -> float:
    return dof + 6 * math.sqrt(2 * dof)  # six standard deviations of a chi-square: a right sampler is far inside


def test_draws_at_temperature_1_follow_the_forwards_softmax(llama: Any) -> None:  # noqa: F811
    prompt = _prompt(40, 30)
    engine = _engine(llama)
    handle, = engine.add(prompt, ALT)
    _run(engine)
    expected = _forward_logprobs(llama, prompt)
    assert handle.prompt_alts is not None and len(handle.prompt_alts) == len(prompt) - 1
    assert all(len(row) == K for row in handle.prompt_alts)
    draws = [[t for t, _ in row] for row in handle.prompt_alts]
    for i, row in enumerate(handle.prompt_alts):  # each draw's logprob is the model's at temperature 1
        assert [v for _, v in row] == pytest.approx(expected[i, [t for t, _ in row]].tolist(), abs=1e-4)
    statistic, dof = _chi_square(draws, expected)
    assert dof > 100 and statistic < _bound(dof), (statistic, dof)
    # The same bound refuses draws from another distribution (the test has the power to see a wrong sampler).
    hot = _engine(llama)
    other, = hot.add(prompt, DecodeSettings(max_tokens=2, temperature=1.6, seed=77, prompt_alt_k=K))
    _run(hot)
    wrong, _ = _chi_square([[t for t, _ in row] for row in other.prompt_alts or []], expected)
    assert wrong > 2 * _bound(dof), (wrong, dof)


@pytest.mark.parametrize("temperature", [0.0, 0.02])
def test_draws_at_a_low_temperature_are_the_argmax(llama: Any, temperature: float) -> None:  # noqa: F811
    prompt = _prompt(41, 20)
    engine = _engine(llama)
    handle, = engine.add(prompt, DecodeSettings(max_tokens=2, temperature=temperature, seed=5, prompt_alt_k=16))
    _run(engine)
    argmax = _forward_logprobs(llama, prompt).argmax(dim=-1).tolist()
    rows = handle.prompt_alts or []
    share = sum(t == argmax[i] for i, row in enumerate(rows) for t, _ in row) / (16 * len(rows))
    assert share == 1.0 if temperature == 0 else share > 0.98  # softmax(logits / 0.02) gives the argmax 0.997


def test_draws_are_the_same_whatever_the_chunks_neighbours_and_cache(llama: Any) -> None:  # noqa: F811
    prompt = _prompt(42, 25)
    settings = DecodeSettings(max_tokens=3, temperature=1.0, seed=123, prompt_alt_k=8)
    alone = _engine(llama, prefill_tokens=512)
    reference, = alone.add(prompt, settings)
    _run(alone)
    # Chunks of 6 tokens, other users' prompts beside it, and its own prompt already in the prefix cache.
    busy = _engine(llama, prefill_tokens=6)
    warm, = busy.add(prompt, DecodeSettings(max_tokens=3))
    _run(busy)
    for i in range(5):
        busy.add(_prompt(300 + i, 4 + 3 * i), DecodeSettings(max_tokens=4, temperature=0.9, seed=i, prompt_alt_k=3),
                 owner=f"other-{i}")
    handle, = busy.add(prompt, settings, owner="me")
    _run(busy)
    assert handle.prompt_cache_hit_tokens == 0  # its KV came from the cache before; the draws need every logit
    assert handle.prompt_alts is not None and reference.prompt_alts is not None
    assert [[t for t, _ in row] for row in handle.prompt_alts] == [[t for t, _ in row] for row in reference.prompt_alts]
    assert handle.tokens == reference.tokens
    again = _engine(llama)
    other_seed, = again.add(prompt, DecodeSettings(max_tokens=3, temperature=1.0, seed=124, prompt_alt_k=8))
    _run(again)
    assert other_seed.prompt_alts != reference.prompt_alts
    assert busy.result(handle)["prompt_alt_tokens"] == [[[t, v] for t, v in row] for row in handle.prompt_alts]


def test_prompt_draws_depend_on_the_counter_only_and_skip_impossible_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(64, -1).contiguous()
    positions = torch.arange(1, 65)
    ids, logprobs = prompt_draws(logits, positions, 512, 1.0, seed=9, seq=0)
    assert ids.shape == (64, 512) and logprobs.dtype == torch.float32
    assert int(ids.max()) <= 2  # probability 0 is never drawn
    freq = torch.bincount(ids.reshape(-1), minlength=4).float() / ids.numel()
    assert freq[:3].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.01)  # 32768 draws: 6 standard errors
    one, _ = prompt_draws(logits[5:6], positions[5:6], 512, 1.0, seed=9, seq=0)
    assert torch.equal(one[0], ids[5])  # row 5 alone draws what it drew beside 63 others
    assert not torch.equal(prompt_draws(logits[5:6], positions[5:6], 512, 1.0, seed=9, seq=1)[0][0], ids[5])


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompts": ["hello"], "prompt_alt_tokens_k": 2}, "token-id prompts"),
    ({"prompt_tokens": [[1, 2]], "prompt_alt_tokens_k": MAX_PROMPT_ALT_TOKENS + 1}, f"0..{MAX_PROMPT_ALT_TOKENS}"),
    ({"prompt_tokens": [[1, 2]], "prompt_alt_tokens_k": -1}, f"0..{MAX_PROMPT_ALT_TOKENS}"),
    ({"prompt_tokens": [[1, 2]], "prompt_alt_tokens_k": "2"}, f"0..{MAX_PROMPT_ALT_TOKENS}"),
    ({"prompt_tokens": [[1] * (MAX_PROMPT_ALT_CELLS // 64 + 2)], "prompt_alt_tokens_k": 64}, "draws"),
], ids=["text", "over", "negative", "string", "cells"])
def test_the_contract_bounds_prompt_alt_tokens_k_naming_it(fields: dict[str, Any], message: str) -> None:
    call = Sample(base_model="tiny", user_id="u", **fields)
    with pytest.raises(BadInput, match=message) as caught:
        call.validate()
        call.check_size(RuntimeOptions(max_sample_prompt_tokens=10**6))
    assert caught.value.field == "prompt_alt_tokens_k"


def test_a_prefill_that_draws_makes_one_host_sync(llama: Any) -> None:  # noqa: F811
    engine = _engine(llama, prefill_tokens=512)
    handles = [h for i in range(4) for h in engine.add(_prompt(90 + i, 9 + i), ALT, seq_ids=[i])]
    with CountSyncs() as mode:
        engine.step()  # every prefill, its draws and its first token
    assert all(h.running for h in handles) and all(len(h.prompt_alts or []) == 8 + i for i, h in enumerate(handles))
    assert mode.count == 1  # the step's one copy (tolist): the draws add none
