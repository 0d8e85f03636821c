"""The decode engine (gpu_runtime/compute/decode) on tiny random models: against transformers' generate and a
teacher-forced forward, seeded draws at any batch size, continuous batching, cancel, the cache's budget, prefix
reuse, stops, and at most one host sync per decode step."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from gpu_runtime.compute.decode.engine import DecodeEngine, DecodeSettings, Handle
from gpu_runtime.compute.decode.slot_cache import SlotCache, refusal

VOCAB = 512
SMALL: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _model(kind: str = "llama") -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        config: Any = LlamaConfig(**SMALL)
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).eval()
    config = MistralConfig(**SMALL, sliding_window=8)
    config._attn_implementation = "sdpa"
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama() -> Any:
    return _model("llama")


def decode_text(ids: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


def _engine(model: Any, slots: int = 16, prefill_tokens: int = 64, max_len: int = 160) -> DecodeEngine:
    return DecodeEngine(model, SlotCache(model.config, max_len, slots=slots), prefill_tokens=prefill_tokens,
                        decode=decode_text)


def _run(engine: DecodeEngine) -> int:
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
    return steps


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


@torch.no_grad()
def _generate(model: Any, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return list(out[0, len(prompt):].tolist())


@torch.no_grad()
def _teacher_forced(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
@pytest.mark.parametrize("prefill_tokens", [7, 512])
def test_greedy_equals_generate(kind: str, prefill_tokens: int) -> None:
    model = _model(kind)
    engine = _engine(model, prefill_tokens=prefill_tokens)
    prompts = [_prompt(i, length) for i, length in enumerate([3, 17, 40, 9])]
    handles = [engine.add(p, DecodeSettings(max_tokens=12))[0] for p in prompts]
    _run(engine)
    for prompt, handle in zip(prompts, handles):
        assert handle.tokens == _generate(model, prompt, 12)
        assert handle.reason == "length"


@pytest.mark.parametrize("settings", [
    DecodeSettings(max_tokens=10, temperature=1.0, seed=3),
    DecodeSettings(max_tokens=10, temperature=0.7, top_k=20, seed=4, logprobs_k=3),
    DecodeSettings(max_tokens=10, temperature=1.3, top_p=0.8, seed=5),
    DecodeSettings(max_tokens=10, temperature=0.0, logprobs_k=5),
])
def test_sampled_logprobs_equal_teacher_forced(llama: Any, settings: DecodeSettings) -> None:
    engine = _engine(llama)
    prompt = _prompt(10, 21)
    handles = engine.add(prompt, settings, num_samples=3)
    engine.add(_prompt(11, 5), DecodeSettings(max_tokens=4, temperature=1.0))  # a neighbour
    _run(engine)
    for handle in handles:
        assert len(handle.tokens) == 10
        assert handle.logprobs == pytest.approx(_teacher_forced(llama, prompt, handle.tokens), abs=1e-4)
        if settings.logprobs_k:
            first = handle.topk[0]
            assert len(first) == settings.logprobs_k and first[0][1] >= first[-1][1]
            assert handle.logprobs[0] <= first[0][1] + 1e-6


@pytest.mark.parametrize("prefill_tokens", [6, 512])
def test_prompt_logprobs_equal_forward(llama: Any, prefill_tokens: int) -> None:
    engine = _engine(llama, prefill_tokens=prefill_tokens)
    prompt = _prompt(20, 19)
    handle, = engine.add(prompt, DecodeSettings(max_tokens=2, prompt_logprobs=True, prompt_topk=4))
    _run(engine)
    with torch.no_grad():
        logprobs = torch.log_softmax(llama(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert handle.prompt_logprobs is not None and handle.prompt_logprobs[0] is None
    assert handle.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert handle.prompt_topk is not None and handle.prompt_topk[0] is None
    top = torch.topk(logprobs[0], 4)
    assert [t for t, _ in handle.prompt_topk[1] or []] == top.indices.tolist()
    assert engine.result(handle)["prompt_logprobs"] == handle.prompt_logprobs


SEEDED = DecodeSettings(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=1234)


@pytest.mark.parametrize("others", [0, 7, 63])
def test_seeded_tokens_same_alone_and_beside_others(llama: Any, others: int) -> None:
    engine = _engine(llama, slots=64, prefill_tokens=4096)
    for i in range(others // 2):  # some before it, some after: it sits in a different slot each time
        engine.add(_prompt(100 + i, 3 + i % 11), DecodeSettings(max_tokens=5 + i % 9, temperature=0.9, seed=i))
    handle, = engine.add(_prompt(7, 15), SEEDED, seq_ids=[2])
    for i in range(others // 2, others):
        engine.add(_prompt(100 + i, 3 + i % 11), DecodeSettings(max_tokens=5 + i % 9, temperature=0.9, top_p=0.5,
                                                                 seed=i))
    _run(engine)
    alone = _engine(llama)
    reference, = alone.add(_prompt(7, 15), SEEDED, seq_ids=[2])
    _run(alone)
    assert handle.tokens == reference.tokens
    assert handle.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_num_samples_are_the_sequences_drawn_alone(llama: Any) -> None:
    engine = _engine(llama)
    prompt = _prompt(30, 12)
    settings = DecodeSettings(max_tokens=8, temperature=1.0, seed=9)
    samples = engine.add(prompt, settings, num_samples=4)
    _run(engine)
    assert len({tuple(h.tokens) for h in samples}) > 1  # different sequence indices: different draws
    for i, sample_handle in enumerate(samples):
        alone = _engine(llama)
        one, = alone.add(prompt, settings, seq_ids=[i])
        _run(alone)
        assert sample_handle.tokens == one.tokens


@pytest.mark.parametrize("prompt_length", [5, 50])
def test_request_added_mid_decode_gets_its_first_token_when_its_prefill_ends(llama: Any, prompt_length: int) -> None:
    engine = _engine(llama, prefill_tokens=16)
    first, = engine.add(_prompt(40, 6), DecodeSettings(max_tokens=40))
    for _ in range(3):
        engine.step()
    assert len(first.tokens) == 3
    late, = engine.add(_prompt(41, prompt_length), DecodeSettings(max_tokens=5))
    chunks = -(-prompt_length // 16)
    for step in range(1, chunks + 1):
        engine.step()
        assert len(first.tokens) == 3 + step  # never stalled by the prefill
        assert len(late.tokens) == (1 if step == chunks else 0)
    engine.step()
    assert len(late.tokens) == 2
    _run(engine)
    assert late.tokens == _generate(llama, _prompt(41, prompt_length), 5)
    assert first.tokens == _generate(llama, _prompt(40, 6), 40)


@pytest.mark.parametrize("when", ["decoding", "prefilling", "waiting"])
def test_cancelled_sequence_frees_its_slot_within_a_step(llama: Any, when: str) -> None:
    engine = _engine(llama, slots=2, prefill_tokens=8)
    keep, = engine.add(_prompt(50, 4), DecodeSettings(max_tokens=30))
    engine.step()
    prompt = _prompt(51, 30 if when == "prefilling" else 4)
    gone, = engine.add(prompt, DecodeSettings(max_tokens=30))
    if when != "waiting":
        engine.step()
    if when == "decoding":
        engine.step()
        assert gone.running
    before = engine.cache.free
    engine.cancel(gone)
    assert gone.reason == "cancelled" and gone.slot == -1
    assert engine.cache.free == before + (0 if when == "waiting" else 1)
    count = len(gone.tokens)
    engine.step()
    assert len(gone.tokens) == count
    assert engine.result(gone)["stop_reason"] == "cancelled"
    _run(engine)
    assert keep.tokens == _generate(llama, _prompt(50, 4), 30)
    assert engine.cache.free == engine.cache.count


def test_cache_stays_within_budget_under_500_sequences(llama: Any) -> None:
    max_len = 64
    per_slot = SlotCache(llama.config, max_len, slots=1).slot_bytes
    budget = per_slot * 12 + per_slot // 2
    engine = DecodeEngine(llama, SlotCache(llama.config, max_len, budget_bytes=budget), prefill_tokens=128)
    assert engine.cache.count == 12 and engine.cache.nbytes <= budget
    rng = random.Random(5)
    handles = [h for i in range(500) for h in engine.add(
        _prompt(1000 + i, rng.randrange(1, 40)), DecodeSettings(max_tokens=rng.randrange(1, 20), temperature=1.0,
                                                                 seed=i))]
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        assert engine.cache.nbytes <= budget and len(engine.by_slot) <= engine.cache.count
    assert all(h.reason == "length" and len(h.tokens) == h.settings.max_tokens for h in handles)
    assert engine.cache.free == engine.cache.count


@pytest.mark.parametrize("source", ["freed", "live"])
def test_repeated_prompt_hits_the_cache(llama: Any, source: str) -> None:
    engine = _engine(llama)
    prompt = _prompt(60, 40)
    first, = engine.add(prompt, DecodeSettings(max_tokens=6 if source == "freed" else 30))
    engine.step()
    if source == "freed":
        _run(engine)
    else:
        engine.step()
    again, = engine.add(prompt, DecodeSettings(max_tokens=6))
    longer, = engine.add(prompt + [7, 8, 9], DecodeSettings(max_tokens=6))
    _run(engine)
    assert first.prompt_cache_hit_tokens == 0
    assert again.prompt_cache_hit_tokens == 39  # all but the last token, whose pass gives the first logits
    # A freed slot is taken as it is by the first prompt matching it (cut to what that prompt shares), a live one
    # copied, so the longer prompt finds 39 or more of its tokens.
    assert longer.prompt_cache_hit_tokens >= (39 if source == "freed" else 40)
    assert again.tokens == _generate(llama, prompt, 6)
    assert longer.tokens == _generate(llama, prompt + [7, 8, 9], 6)
    assert engine.result(again)["prompt_cache_hit_tokens"] == 39


def test_stop_token_and_stop_string_end_with_stop(llama: Any) -> None:
    prompt = _prompt(70, 9)
    reference = _generate(llama, prompt, 20)
    text = decode_text(reference)
    engine = _engine(llama)
    by_token, = engine.add(prompt, DecodeSettings(max_tokens=20), stop_token_ids=[reference[6]])
    stop = text[8:10]
    by_string, = engine.add(prompt, DecodeSettings(max_tokens=20), stop_strings=[stop, "@@"])
    plain, = engine.add(prompt, DecodeSettings(max_tokens=20), stop_strings=["@@"])
    _run(engine)
    cut = reference.index(reference[6]) + 1
    assert by_token.reason == "stop" and by_token.tokens == reference[:cut]
    assert by_token.text == decode_text(reference[:cut - 1])
    at = text.find(stop)
    assert by_string.reason == "stop" and by_string.text == text[:at]
    assert by_string.tokens == reference[:at + len(stop)]
    assert plain.reason == "length" and engine.result(plain)["text"] == text


SYNCS = [torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.nonzero, torch.Tensor.nonzero]


class CountSyncs(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("settings", [
    DecodeSettings(max_tokens=20),
    DecodeSettings(max_tokens=20, temperature=0.8, top_k=30, top_p=0.9, seed=1, logprobs_k=2),
])
def test_at_most_one_host_sync_per_decode_step(llama: Any, settings: DecodeSettings) -> None:
    engine = _engine(llama, prefill_tokens=512)
    handles = [h for i in range(8) for h in engine.add(_prompt(80 + i, 5 + i), settings, stop_strings=["zz"])]
    engine.step()  # every prefill and first token
    assert all(h.running for h in handles)
    with CountSyncs() as mode:
        for _ in range(5):
            engine.step()
    assert mode.count <= 5  # the one copy (tolist) per step; the forward and the sampler add none
    assert mode.count == 5


def _flash() -> Any:
    config = LlamaConfig(**SMALL)
    config._attn_implementation = "flash_attention_2"
    return config


def _mixed(kind: str) -> Any:
    """A model mixing full and sliding-window layers (window 8, shorter than the prompts)."""
    torch.manual_seed(0)
    if kind == "qwen2":
        config: Any = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1)
        config._attn_implementation = "sdpa"
        return Qwen2ForCausalLM(config).eval()
    config = Gemma2Config(**{**SMALL, "head_dim": 16}, sliding_window=8, query_pre_attn_scalar=16)
    config._attn_implementation = "eager"
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_mixed_full_and_sliding_layers_decode_what_generate_does(kind: str) -> None:
    model = _mixed(kind)
    assert set(model.config.layer_types) == {"full_attention", "sliding_attention"} and refusal(model.config) is None
    engine = _engine(model, prefill_tokens=7)
    prompts = [_prompt(i, length) for i, length in enumerate([3, 17, 30])]
    handles = [engine.add(p, DecodeSettings(max_tokens=12))[0] for p in prompts]
    _run(engine)
    for prompt, handle in zip(prompts, handles):
        assert handle.tokens == _generate(model, prompt, 12)


def _hybrid(kind: str) -> Any:
    """Qwen3.5: Gated DeltaNet (linear-attention) layers, whose state is recurrent, between full-attention ones."""
    torch.manual_seed(0)
    shape = dict(SMALL, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, initializer_range=0.08,
                 layer_types=["linear_attention", "full_attention"] * 2)
    if kind == "qwen3_5":
        model: Any = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape))
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32, shared_expert_intermediate_size=32))
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("prefill_tokens", [7, 512])
def test_linear_attention_layers_decode_what_generate_does(kind: str, prefill_tokens: int) -> None:
    # Prompts join while others decode and prefill by chunks; each prompt's two samples copy its state.
    model = _hybrid(kind)
    engine = _engine(model, prefill_tokens=prefill_tokens)
    assert engine.cache.states is not None and engine.cache.layers == 2
    prompts = [_prompt(0, 3), _prompt(1, 17), _prompt(2, 30), _prompt(1, 17)]  # the last repeats a live prompt
    handles = []
    for prompt in prompts:
        handles.append(engine.add(prompt, DecodeSettings(max_tokens=12), num_samples=2))
        engine.step()
    _run(engine)
    for prompt, pair in zip(prompts, handles):
        expected = _generate(model, prompt, 12)
        assert [h.tokens for h in pair] == [expected, expected]
        assert [h.prompt_cache_hit_tokens for h in pair] == [0, 0]  # no prefix reuse: a state is a whole sequence's


@pytest.mark.parametrize(("make", "reason"), [
    (_flash, "flash_attention_2"),
])
def test_unsupported_families_are_refused_with_a_reason(make: Callable[[], Any], reason: str) -> None:
    config = make()
    assert reason in (refusal(config) or "")
    with pytest.raises(ValueError, match="no slot cache"):
        SlotCache(config, 32, slots=1)


def test_handles_are_handles(llama: Any) -> None:
    engine = _engine(llama)
    handle, = engine.add([1, 2, 3], DecodeSettings(max_tokens=1))
    assert isinstance(handle, Handle) and not handle.done
    ended = engine.step()
    assert ended == [handle] and handle.reason == "length" and engine.cache.free == engine.cache.count


def test_a_prefix_is_reused_only_from_kv_of_the_same_weights(llama: Any) -> None:
    engine = _engine(llama)
    prompt = _prompt(5, 40)
    first = engine.add(prompt, DecodeSettings(max_tokens=2), weights=1)[0]
    _run(engine)
    other = engine.add(prompt, DecodeSettings(max_tokens=2), weights=2)[0]  # another adapter: its own KV
    _run(engine)
    same = engine.add(prompt, DecodeSettings(max_tokens=2), weights=1)[0]
    _run(engine)
    assert (first.prompt_cache_hit_tokens, other.prompt_cache_hit_tokens, same.prompt_cache_hit_tokens) == (0, 0, 39)


def test_linear_attention_decode_step_makes_one_host_sync() -> None:
    # Gathering and writing back the rows' recurrent state reads nothing back, so the CUDA graph may capture it.
    engine = _engine(_hybrid("qwen3_5_moe"), prefill_tokens=512)
    handles = [h for i in range(4) for h in engine.add(_prompt(80 + i, 6), DecodeSettings(max_tokens=20))]
    engine.step()  # one width: every prompt prefills in this pass and draws its first token
    assert all(h.running for h in handles)
    with CountSyncs() as mode:
        for _ in range(5):
            engine.step()
    assert mode.count == 5
