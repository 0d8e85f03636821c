"""The chunked loss head (gpu_runtime/compute/loss_head.py) against the full-vocabulary reference it replaces.

Reference: log_softmax(hidden.float() @ weight.float().T + bias [+ LoRA], -1).gather(targets), in fp32 on the same
(rounded) inputs. fp32 agrees within 1e-5 (absolute and relative). bf16: the chunked head's matmuls run in bf16, as
the model's own lm_head and its autograd do, so logits carry bf16's rounding (|z|·2⁻⁹) that the fp32 reference does
not: logprobs agree within 3e-2 (absolute and relative), and each gradient within 3% of its largest element (an
element summed over tokens with cancellation can lose its own relative precision, so not elementwise).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from gpu_runtime.compute.loss_head import LowRank, causal_lm_logprobs, decoder_hidden, output_head, token_logprobs

TOKENS, HIDDEN, RANK = 23, 16, 4
FP32_TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL: dict[str, Any] = {"atol": 3e-2, "rtol": 3e-2}
TOL: dict[torch.dtype, dict[str, Any]] = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str = "") -> None:
    assert got.dtype == want.dtype, name
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{name}: {m}")
        return
    error, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert error <= 0.03 * scale, f"{name}: max error {error:.4g} over 3% of its largest element {scale:.4g}"


def make(vocab: int, dtype: torch.dtype, bias: bool, trainable: bool, low_rank: bool, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (TOKENS,), generator=g)
    targets[::5] = -100  # every fifth position ignored
    return {
        "hidden": torch.randn(TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_(),
        "weight": (torch.randn(vocab, HIDDEN, generator=g) * 0.5).to(dtype).requires_grad_(trainable),
        "bias": (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_(trainable) if bias else None,
        "low_rank": LowRank(torch.randn(RANK, HIDDEN, generator=g).requires_grad_(),  # fp32 masters, as the runtime's
                            (torch.randn(vocab, RANK, generator=g) * 0.1).requires_grad_(), 0.5) if low_rank else None,
        "targets": targets,
        "grad": torch.randn(TOKENS, generator=g),
    }


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       low_rank: LowRank | None = None, softcap: float | None = None) -> torch.Tensor:
    """The full [T, V] log-softmax in fp32."""
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    if low_rank is not None:
        logits = logits + low_rank.scaling * (hidden.float() @ low_rank.a.float().T) @ low_rank.b.float().T
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits, dim=-1)


def gather(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    picked = logprobs.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(ids < 0, 0.0, picked)


def leaves(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    named = {"hidden": case["hidden"], "weight": case["weight"], "bias": case["bias"]}
    if case["low_rank"] is not None:
        named |= {"lora_a": case["low_rank"].a, "lora_b": case["low_rank"].b}
    return {name: t for name, t in named.items() if t is not None and t.requires_grad}


def grads(value: torch.Tensor, weights: torch.Tensor, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    named = leaves(case)
    return dict(zip(named, torch.autograd.grad((value * weights).sum(), list(named.values()))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [48, 37], ids=["vocab48", "vocab37"])  # 37: the last chunk of 16 holds 5 columns
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("low_rank", [False, True], ids=["nolora", "lora"])
def test_values_and_gradients_match_the_full_log_softmax(dtype: torch.dtype, vocab: int, bias: bool, trainable: bool,
                                                         low_rank: bool) -> None:
    case = make(vocab, dtype, bias, trainable, low_rank)
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                         chunk_size=16, row_chunk=7)
    expected = gather(reference_logprobs(case["hidden"], case["weight"], case["bias"], case["low_rank"]), case["targets"])
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected, **TOL[dtype])
    got, want = grads(out.logprobs, case["grad"], case), grads(expected, case["grad"], case)
    assert set(got) == {"hidden"} | ({"weight"} | ({"bias"} if bias else set()) if trainable else set()) | (
        {"lora_a", "lora_b"} if low_rank else set())
    for name in want:
        assert_grad_close(got[name], want[name], dtype, name)


@pytest.mark.parametrize("chunk_size,row_chunk", [(1, 1), (5, 3), (37, 23), (1000, 1000)])
def test_block_shape_does_not_change_the_result(chunk_size: int, row_chunk: int) -> None:
    case = make(37, torch.float32, True, True, True)
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                         chunk_size=chunk_size, row_chunk=row_chunk)
    expected = gather(reference_logprobs(case["hidden"], case["weight"], case["bias"], case["low_rank"]), case["targets"])
    torch.testing.assert_close(out.logprobs, expected, **FP32_TOL)
    got, want = grads(out.logprobs, case["grad"], case), grads(expected, case["grad"], case)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_matches_gemma2s_capped_logits(dtype: torch.dtype) -> None:
    case = make(37, dtype, False, True, False)
    case["hidden"].data.mul_(4)  # logits of several units, so the cap bends them
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], softcap=3.0, chunk_size=16, row_chunk=7)
    expected = gather(reference_logprobs(case["hidden"], case["weight"], softcap=3.0), case["targets"])
    torch.testing.assert_close(out.logprobs, expected, **TOL[dtype])
    got, want = grads(out.logprobs, case["grad"], case), grads(expected, case["grad"], case)
    for name in want:
        assert_grad_close(got[name], want[name], dtype, name)


def test_ignored_targets_get_zero_logprob_and_no_gradient() -> None:
    case = make(37, torch.float32, True, True, True)
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                         chunk_size=16)
    ignored = case["targets"] < 0
    assert ignored.any() and (out.logprobs[ignored] == 0).all()
    (grad_hidden,) = torch.autograd.grad((out.logprobs * case["grad"]).sum(), [case["hidden"]])
    assert (grad_hidden[ignored] == 0).all() and (grad_hidden[~ignored] != 0).any()
    # the same as the loss over the kept positions alone
    kept = token_logprobs(case["hidden"][~ignored], case["weight"], case["targets"][~ignored], case["bias"],
                          low_rank=case["low_rank"], chunk_size=16)
    torch.testing.assert_close(kept.logprobs, out.logprobs[~ignored], **FP32_TOL)


def test_a_target_past_the_vocabulary_gives_nan_not_a_silent_zero() -> None:
    case = make(37, torch.float32, False, False, False)
    targets = case["targets"].clone()
    targets[1] = 37
    with torch.no_grad():
        out = token_logprobs(case["hidden"], case["weight"], targets, chunk_size=16)
    assert out.logprobs[1].isnan() and not out.logprobs[2:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k_soft", [1, 4])
def test_soft_targets_equal_the_weighted_sum_of_reference_logprobs(dtype: torch.dtype, k_soft: int) -> None:
    case = make(37, dtype, True, True, True)
    g = torch.Generator().manual_seed(1)
    soft_ids = torch.randint(0, 37, (TOKENS, k_soft), generator=g)
    soft_ids[::3, -1] = -100  # a teacher that gave fewer than K
    soft_weights = torch.softmax(torch.randn(TOKENS, k_soft, generator=g), -1)
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                         soft_targets=soft_ids, soft_weights=soft_weights, chunk_size=16, row_chunk=7)
    full = reference_logprobs(case["hidden"], case["weight"], case["bias"], case["low_rank"])
    expected_each = gather(full.unsqueeze(1).expand(-1, k_soft, -1), soft_ids)
    expected = (expected_each * soft_weights).sum(-1)
    assert out.soft is not None and out.soft_logprobs is not None and out.soft_logprobs.shape == (TOKENS, k_soft)
    torch.testing.assert_close(out.soft_logprobs, expected_each, **TOL[dtype])
    torch.testing.assert_close(out.soft, expected, **TOL[dtype])
    # hard and soft together: one backward through both, as a distillation loss mixing them would
    mixed, mixed_ref = out.logprobs + 0.5 * out.soft, gather(full, case["targets"]) + 0.5 * expected
    got, want = grads(mixed, case["grad"], case), grads(mixed_ref, case["grad"], case)
    for name in want:
        assert_grad_close(got[name], want[name], dtype, name)


@pytest.mark.parametrize("k", [1, 5, 20, 37])  # 20: more than a chunk of 16 holds; 37: the whole vocabulary
def test_topk_equals_torch_topk_of_the_reference(k: int) -> None:
    case = make(37, torch.float32, True, False, False)
    with torch.no_grad():
        out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], topk=k, chunk_size=16,
                             row_chunk=7)
        values, ids = reference_logprobs(case["hidden"], case["weight"], case["bias"]).topk(k, dim=-1)
    assert out.topk_logprobs is not None and out.topk_ids is not None
    torch.testing.assert_close(out.topk_logprobs, values, **FP32_TOL)
    assert torch.equal(out.topk_ids, ids)


def test_entropy_and_logsumexp_match_the_reference() -> None:
    case = make(37, torch.float32, True, False, True)
    out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                         entropy=True, topk=3, chunk_size=16, row_chunk=7)
    full = reference_logprobs(case["hidden"], case["weight"], case["bias"], case["low_rank"])
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy, -(full.exp() * full).sum(-1), **FP32_TOL)
    low_rank = case["low_rank"]
    logits = case["hidden"] @ case["weight"].T + case["bias"] + low_rank.scaling * (case["hidden"] @ low_rank.a.T) @ low_rank.b.T
    torch.testing.assert_close(out.logsumexp, torch.logsumexp(logits, -1), **FP32_TOL)
    # the entropy and top-k are no-grad side outputs: the logprobs' gradient is unchanged by asking for them
    plain = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                           chunk_size=16, row_chunk=7)
    assert not out.entropy.requires_grad and out.topk_logprobs is not None and not out.topk_logprobs.requires_grad
    torch.testing.assert_close(grads(out.logprobs, case["grad"], case)["hidden"], grads(plain.logprobs, case["grad"], case)["hidden"])


@contextmanager
def saved_tensors() -> Iterator[list[torch.Size]]:
    """The shapes autograd saves for backward while inside."""
    shapes: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield shapes


def test_no_grad_keeps_nothing() -> None:
    case = make(37, torch.float32, True, True, True)
    with torch.no_grad(), saved_tensors() as shapes:
        out = token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                             soft_targets=case["targets"][:, None], soft_weights=torch.ones(TOKENS, 1), topk=2,
                             entropy=True, chunk_size=16)
    assert shapes == []
    assert all(t is None or t.grad_fn is None for t in (out.logprobs, out.soft, out.soft_logprobs, out.entropy))


def test_with_grad_only_inputs_and_per_token_values_are_saved() -> None:
    case = make(37, torch.float32, True, True, True)
    with saved_tensors() as shapes:
        token_logprobs(case["hidden"], case["weight"], case["targets"], case["bias"], low_rank=case["low_rank"],
                       chunk_size=16)
    assert shapes and all(s.numel() <= max(37 * HIDDEN, TOKENS * HIDDEN) for s in shapes)
    assert (TOKENS, 37) not in shapes


def test_leading_dims_are_kept() -> None:
    case = make(37, torch.float32, False, False, False)
    out = token_logprobs(case["hidden"][:20].reshape(4, 5, HIDDEN), case["weight"], case["targets"][:20].reshape(4, 5),
                         topk=2, chunk_size=16)
    flat = token_logprobs(case["hidden"][:20], case["weight"], case["targets"][:20], topk=2, chunk_size=16)
    assert out.logprobs.shape == (4, 5) and out.topk_ids is not None and out.topk_ids.shape == (4, 5, 2)
    torch.testing.assert_close(out.logprobs.reshape(-1), flat.logprobs)


def tiny_causal_lm(family: str) -> Any:  # a PreTrainedModel: lm_head, config
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = {"vocab_size": 101, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    if family == "gemma2":  # softcapped logits (30 would barely bend logits this small: 2 does)
        model: Any = Gemma2ForCausalLM(Gemma2Config(**shape, final_logit_softcapping=2.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=family == "llama-tied"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # larger than the init's, so the logits spread and the softmax is not flat
    return model


@pytest.mark.parametrize("family", ["llama", "llama-tied", "gemma2"])
def test_causal_lm_helper_equals_the_models_own_logits(family: str) -> None:
    model = tiny_causal_lm(family)
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 101, (3, 9), generator=g)
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0  # a padded row
    targets = torch.cat([input_ids[:, 1:], torch.full((3, 1), -100)], dim=1).masked_fill(attention_mask == 0, -100)
    weights = torch.randn(3, 9, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    out = causal_lm_logprobs(model, input_ids, targets, attention_mask=attention_mask, chunk_size=16, row_chunk=7)
    got = torch.autograd.grad((out.logprobs * weights).sum(), params)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    expected = gather(torch.log_softmax(logits.float(), -1), targets)
    want = torch.autograd.grad((expected * weights).sum(), params)
    torch.testing.assert_close(out.logprobs, expected, **FP32_TOL)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, **FP32_TOL)
    _, _, softcap = output_head(model)
    assert softcap == (2.0 if family == "gemma2" else None)


def test_decoder_hidden_is_the_normed_state_the_head_reads() -> None:
    model = tiny_causal_lm("llama")
    input_ids = torch.randint(0, 101, (2, 5))
    hidden = decoder_hidden(model, input_ids)
    torch.testing.assert_close(model.lm_head(hidden), model(input_ids=input_ids).logits)


def test_output_head_refuses_what_it_cannot_reproduce() -> None:
    model = tiny_causal_lm("llama")

    class Wrapped(torch.nn.Linear):  # stands in for a LoRA wrapper or a quantized layer
        pass

    head = model.lm_head
    model.lm_head = Wrapped(32, 101, bias=False)
    with pytest.raises(TypeError, match="not an nn.Linear"):
        output_head(model)
    model.lm_head = head
    model.config.logit_scale = 0.5  # Cohere's
    with pytest.raises(NotImplementedError, match="logit_scale"):
        output_head(model)


def test_mismatched_shapes_are_refused() -> None:
    case = make(37, torch.float32, False, False, False)
    with pytest.raises(ValueError, match="leading dims"):
        token_logprobs(case["hidden"], case["weight"], case["targets"][:-1])
    with pytest.raises(ValueError, match="soft_targets"):
        token_logprobs(case["hidden"], case["weight"], case["targets"], soft_targets=case["targets"][:, None])


@pytest.mark.parametrize("hidden_dtype,weight_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_mixed_dtypes_compute_in_the_wider_one(hidden_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    case = make(37, torch.float32, True, True, False)
    hidden = case["hidden"].detach().to(hidden_dtype).requires_grad_()
    weight = case["weight"].detach().to(weight_dtype).requires_grad_()
    out = token_logprobs(hidden, weight, case["targets"], chunk_size=16, row_chunk=7)
    expected = gather(reference_logprobs(hidden, weight), case["targets"])
    torch.testing.assert_close(out.logprobs, expected, **FP32_TOL)  # fp32 matmuls on the rounded values: exact-ish
    got = torch.autograd.grad((out.logprobs * case["grad"]).sum(), [hidden, weight])
    want = torch.autograd.grad((expected * case["grad"]).sum(), [hidden, weight])
    for g_got, g_want, dtype in zip(got, want, (hidden_dtype, weight_dtype)):
        assert g_got.dtype == dtype
        torch.testing.assert_close(g_got, g_want, **TOL[dtype])
