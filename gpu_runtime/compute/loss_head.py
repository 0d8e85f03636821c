"""A fused, chunked loss head: per-token logprobs of the targets without ever holding the [tokens, vocab] logits.

Today a pass computes `model(...).logits` for every position over the whole vocabulary, then an fp32 copy and an
fp32 log-softmax that backward keeps: at 8 × 1024 tokens and a 128k vocabulary that is over 12 GB, transient.
Here the output projection runs block by block, `row_chunk` tokens × `chunk_size` vocabulary columns at a time:
forward keeps a running log-sum-exp (online softmax, fp32) and gathers the targets' logits; backward recomputes
each block's logits and adds its (one-hot − softmax) · grad into grad_hidden (and into the head's weight, bias and
low-rank pair where they require grad). What survives forward for backward is its inputs plus one fp32 scalar per
token: peak memory is bounded by a block, not by tokens × vocabulary.

Instead of `model(...).logits`:

    hidden = decoder_hidden(model, input_ids=ids, attention_mask=mask)      # [B, S, H]: the final norm's output
    weight, bias, softcap = output_head(model)                              # the lm_head (tied or not)
    out = token_logprobs(hidden, weight, targets, bias, softcap=softcap)    # targets [B, S], -100 where ignored
    out.logprobs                                                            # [B, S] fp32, what losses.py's
                                                                            # target_logprobs(logits, targets) gives

(`causal_lm_logprobs(model, ids, targets, attention_mask=mask)` does the three.) The logprobs then feed the losses
in gpu_runtime/losses.py unchanged.

A LoRA on the unembedding: pass its pair as `low_rank=LowRank(a [r, H], b [V, r], scaling)`; the block's logits
are then hidden·Wᵀ + scaling·(hidden·Aᵀ)·Bᵀ and A and B get their gradients. The runtime's routed head (one pass,
several runs' adapters, gpu_runtime/multilora.py) calls `token_logprobs` once per run's row span with that run's
pair; `output_head` refuses any head that is not a plain `nn.Linear` rather than silently dropping a delta.

Precision: each block's matmul runs in the operands' dtype (bf16 where the base computes in bf16, as the model's
own lm_head would), its result is cast to fp32, and everything after (log-sum-exp, softmax, gradients'
accumulation) is fp32. Imports torch and the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_CHUNK_SIZE = 8192  # vocabulary columns per block
DEFAULT_ROW_CHUNK = 2048  # tokens per block: 2048 × 8192 fp32 is 64 MB, and a block holds a few such


@dataclass(frozen=True)
class LowRank:
    """A LoRA on the output projection: logits gain scaling · (hidden @ a.T) @ b.T."""

    a: torch.Tensor  # [r, H]
    b: torch.Tensor  # [V, r]
    scaling: float


@dataclass(frozen=True)
class HeadOutput:
    """What one pass of the head gives, each over the caller's leading dims (`...` below: [T] or [B, S])."""

    logprobs: torch.Tensor  # [...] fp32: log p(target); 0 where the target is ignored (< 0); NaN where it is >= vocab
    logsumexp: torch.Tensor  # [...] fp32, no gradient: the log of the softmax's normaliser
    soft_logprobs: torch.Tensor | None = None  # [..., K] fp32: log p of each soft target (0 where its id is < 0)
    soft: torch.Tensor | None = None  # [...] fp32: Σ_k soft_weights·soft_logprobs (a teacher's top-K, weighted)
    topk_logprobs: torch.Tensor | None = None  # [..., k] fp32, no gradient, highest first
    topk_ids: torch.Tensor | None = None  # [..., k] int64
    entropy: torch.Tensor | None = None  # [...] fp32, no gradient: -Σ p·log p over the vocabulary


def _block_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, projected: torch.Tensor | None,
                  lora_b: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """One block's logits before any softcap, in the matmul's dtype: hidden [R, H] × weight [C, H] (+ bias, + LoRA)."""
    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    if projected is not None and lora_b is not None:
        logits = logits.addmm_(projected, lora_b.T, alpha=scaling)
    return logits


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _head_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
                  lora_b: torch.Tensor | None, scaling: float, ids: torch.Tensor, softcap: float | None, chunk_size: int,
                  row_chunk: int, topk: int, want_entropy: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], ids [T, M] → (logprobs [T, M], lse [T], topk logprobs [T, k], topk ids [T, k], entropy [T or 0]).

    Outer loop over vocabulary chunks (the weight is read once), inner over row chunks; the running state per token
    is a max, a sum of exponentials (and their logit-weighted sum for the entropy), its targets' logits and a top-k.
    """
    tokens, vocab = hidden.shape[0], weight.shape[0]
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device
    f32 = torch.float32
    a_c, b_c = _cast(lora_a, dtype), _cast(lora_b, dtype)  # [r, H], [V, r]: small
    hidden_c = hidden.to(dtype)
    projected = hidden_c @ a_c.T if a_c is not None else None  # [T, r]: the LoRA's shrink, once
    running_max = torch.full((tokens,), -math.inf, dtype=f32, device=device)
    running_sum = torch.zeros(tokens, dtype=f32, device=device)
    running_zsum = torch.zeros(tokens if want_entropy else 0, dtype=f32, device=device)  # Σ exp(z - max)·z
    # NaN until a chunk holds the id: an id >= vocab stays NaN (the caller's NaN-loss check catches it, no host sync)
    picked = torch.where(ids < 0, 0.0, math.nan).to(f32)
    k = min(topk, vocab)
    top_values = torch.full((tokens, k), -math.inf, dtype=f32, device=device)
    top_ids = torch.zeros((tokens, k), dtype=torch.int64, device=device)
    for start in range(0, vocab, chunk_size):
        end = min(start + chunk_size, vocab)
        columns = slice(start, end)
        weight_c, bias_c = weight[columns].to(dtype), _cast(None if bias is None else bias[columns], dtype)  # per chunk: no [V, H] copy
        in_chunk = (ids >= start) & (ids < end)
        local = (ids - start).clamp(0, end - start - 1)
        for row_start in range(0, tokens, row_chunk):
            rows = slice(row_start, min(row_start + row_chunk, tokens))
            z = _block_logits(hidden_c[rows], weight_c, bias_c,
                              None if projected is None else projected[rows], None if b_c is None else b_c[columns],
                              scaling).to(f32)
            if softcap:
                z = torch.tanh(z.div_(softcap)).mul_(softcap)
            block_max = torch.maximum(running_max[rows], z.amax(dim=1))
            rescale = torch.exp(running_max[rows] - block_max)
            running_max[rows] = block_max
            picked[rows] = torch.where(in_chunk[rows], z.gather(1, local[rows]), picked[rows])
            if k:
                values, where = z.topk(min(k, end - start), dim=1)
                merged_values, order = torch.cat([top_values[rows], values], dim=1).topk(k, dim=1)
                top_ids[rows] = torch.cat([top_ids[rows], where + start], dim=1).gather(1, order)
                top_values[rows] = merged_values
            exponentials = z.sub_(block_max[:, None]).exp_() if not want_entropy else torch.exp(z - block_max[:, None])
            if want_entropy:
                running_zsum[rows] = running_zsum[rows] * rescale + (exponentials * z).sum(dim=1)
            running_sum[rows] = running_sum[rows] * rescale + exponentials.sum(dim=1)
    lse = running_max + running_sum.log()
    logprobs = torch.where(ids < 0, 0.0, picked - lse[:, None])
    entropy = lse - running_zsum / running_sum if want_entropy else running_zsum
    return logprobs, lse, top_values - lse[:, None], top_ids, entropy


class ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias [+ LoRA], softcapped).gather(ids), block by block, with its backward.

    apply(hidden [T, H], weight [V, H], bias [V] | None, lora_a [r, H] | None, lora_b [V, r] | None, scaling,
          ids [T, M] int64 (< 0: ignored), softcap | None, chunk_size, row_chunk, topk, want_entropy)
    → (logprobs [T, M] fp32, lse [T], topk logprobs [T, k], topk ids [T, k], entropy [T] or [0]); only the first
    is differentiable. Saved for backward: the inputs and lse [T]; each block's logits are recomputed there.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, scaling: float, ids: torch.Tensor,
                softcap: float | None, chunk_size: int, row_chunk: int, topk: int, want_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        outputs = _head_forward(hidden, weight, bias, lora_a, lora_b, scaling, ids, softcap, chunk_size, row_chunk,
                                topk, want_entropy)
        ctx.save_for_backward(hidden, weight, bias, lora_a, lora_b, ids, outputs[1])
        ctx.settings = (scaling, softcap, chunk_size, row_chunk)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, lora_a, lora_b, ids, lse = ctx.saved_tensors
        scaling, softcap, chunk_size, row_chunk = ctx.settings
        need_hidden, need_weight, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        f32 = torch.float32
        a_c, b_c = _cast(lora_a, dtype), _cast(lora_b, dtype)
        hidden_c = hidden.to(dtype)
        projected = hidden_c @ a_c.T if a_c is not None else None
        valid = ids >= 0
        grad = torch.where(valid, grad_logprobs.to(f32), 0.0)  # [T, M]: an ignored target gets no gradient
        grad_total = grad.sum(dim=1, keepdim=True)  # what the softmax term of every target weighs
        grad_hidden = torch.zeros(hidden.shape, dtype=f32, device=hidden.device) if need_hidden else None
        grad_projected = (torch.zeros((tokens, lora_a.shape[0]), dtype=f32, device=hidden.device)
                          if lora_a is not None and (need_hidden or need_a) else None)
        grad_weight = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=f32, device=weight.device) if need_bias else None
        grad_b = torch.zeros(lora_b.shape, dtype=f32, device=lora_b.device) if need_b else None
        for start in range(0, vocab, chunk_size):
            end = min(start + chunk_size, vocab)
            columns = slice(start, end)
            weight_c, bias_c = weight[columns].to(dtype), _cast(None if bias is None else bias[columns], dtype)
            in_chunk = (ids >= start) & (ids < end)
            local = (ids - start).clamp(0, end - start - 1)
            grad_in_chunk = torch.where(in_chunk, grad, 0.0)
            for row_start in range(0, tokens, row_chunk):
                rows = slice(row_start, min(row_start + row_chunk, tokens))
                z = _block_logits(hidden_c[rows], weight_c, bias_c,
                                  None if projected is None else projected[rows], None if b_c is None else b_c[columns],
                                  scaling).to(f32)
                capped = torch.tanh(z / softcap) if softcap else None
                if capped is not None:
                    z = capped * softcap
                # d logp(id) / d z = onehot(id) - softmax: summed over a token's targets, weighted by their grads
                grad_z = z.sub_(lse[rows, None]).exp_().mul_(-grad_total[rows])
                grad_z.scatter_add_(1, local[rows], grad_in_chunk[rows])
                if capped is not None:
                    grad_z.mul_(1 - capped * capped)
                grad_zc = grad_z.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] += grad_zc @ weight_c
                if grad_projected is not None and b_c is not None:
                    grad_projected[rows] += (grad_zc @ b_c[columns]).mul_(scaling)
                if grad_weight is not None:
                    grad_weight[columns] += grad_zc.T @ hidden_c[rows]
                if grad_bias is not None:
                    grad_bias[columns] += grad_z.sum(dim=0)
                if grad_b is not None and projected is not None:
                    grad_b[columns] += (grad_zc.T @ projected[rows]).mul_(scaling)
        grad_a = None
        if grad_projected is not None and a_c is not None:
            if grad_hidden is not None:
                grad_hidden += grad_projected.to(dtype) @ a_c
            if need_a:
                grad_a = (grad_projected.to(dtype).T @ hidden_c).to(lora_a.dtype)
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                grad_a,
                None if grad_b is None else grad_b.to(lora_b.dtype),
                None, None, None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
                   *, low_rank: LowRank | None = None, soft_targets: torch.Tensor | None = None,
                   soft_weights: torch.Tensor | None = None, topk: int = 0, entropy: bool = False,
                   softcap: float | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   row_chunk: int = DEFAULT_ROW_CHUNK) -> HeadOutput:
    """log p(targets) under softmax(hidden @ weight.T + bias), chunked: the [tokens, vocab] logits never exist at once.

    hidden [..., H] (any float dtype: the final norm's output), weight [V, H], targets [...] int64 (< 0, e.g. -100:
    ignored: logprob 0, no gradient), bias [V]. soft_targets [..., K] ids with soft_weights [..., K]: a teacher's
    top-K; `soft` is their weighted sum of logprobs (minimise -soft for distillation). `topk` > 0: the top-k
    logprobs and ids per position (prompt top-k logprobs); `entropy`: the softmax's entropy. softcap: Gemma 2's
    final_logit_softcapping (logits = cap·tanh(logits / cap)). Gradients reach hidden, and weight, bias and the
    low-rank pair where they require grad. Without grad mode (or with nothing requiring grad) nothing is kept.
    """
    lead = targets.shape
    if hidden.shape[:-1] != lead:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(lead)} disagree on the leading dims")
    if chunk_size < 1 or row_chunk < 1:
        raise ValueError("chunk_size and row_chunk must be at least 1")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    ids = targets.reshape(-1, 1).long()
    soft_count = 0
    if soft_targets is not None:
        if soft_weights is None or soft_targets.shape != soft_weights.shape or soft_targets.shape[:-1] != lead:
            raise ValueError("soft_targets and soft_weights must both be given, shaped [..., K] like targets + K")
        soft_count = soft_targets.shape[-1]
        ids = torch.cat([ids, soft_targets.reshape(-1, soft_count).long()], dim=1)
    lora_a, lora_b, scaling = (low_rank.a, low_rank.b, float(low_rank.scaling)) if low_rank else (None, None, 0.0)
    inputs = (flat_hidden, weight, bias, lora_a, lora_b)
    args = (flat_hidden, weight, bias, lora_a, lora_b, scaling, ids, softcap, chunk_size, row_chunk, topk, entropy)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        picked, lse, top_values, top_ids, entropies = ChunkedLogprobs.apply(*args)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    else:  # a forward: no autograd node, nothing saved
        picked, lse, top_values, top_ids, entropies = _head_forward(*args)
    soft_logprobs = picked[:, 1:].reshape(*lead, soft_count) if soft_targets is not None else None
    return HeadOutput(
        logprobs=picked[:, 0].reshape(lead),
        logsumexp=lse.reshape(lead),
        soft_logprobs=soft_logprobs,
        soft=None if soft_logprobs is None or soft_weights is None else (soft_logprobs * soft_weights.to(torch.float32)).sum(-1),
        topk_logprobs=top_values.reshape(*lead, -1) if topk else None,
        topk_ids=top_ids.reshape(*lead, -1) if topk else None,
        entropy=entropies.reshape(lead) if entropy else None,
    )


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def output_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """(weight [V, H], bias or None, softcap or None) of a transformers causal LM's output projection.

    Tied embeddings need nothing: the lm_head's weight is the input embedding's tensor, and its gradient (if it
    requires one) accumulates into that one tensor. A head that is not a plain nn.Linear (a LoRA wrapper, a
    quantized layer) and post-head logit scalings other than Gemma 2's softcap are refused: pass them yourself.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:  # exact type: a subclass (a LoRA wrapper) may change what it computes
        raise TypeError(f"the output projection is a {type(head).__name__}, not an nn.Linear: pass its weight, bias and "
                        "any LoRA pair to token_logprobs yourself")
    return head.weight, head.bias, logit_softcap(model)


def logit_softcap(model: nn.Module) -> float | None:
    """Gemma 2's final_logit_softcapping, or None; a model that scales its logits after the head otherwise is refused."""
    config = _text_config(model)
    for name, neutral in (("logit_scale", 1.0), ("logits_scaling", 1.0)):  # Cohere multiplies, Granite divides
        value = getattr(config, name, None)
        if value is not None and float(value) != neutral:
            raise NotImplementedError(f"the model scales its logits after the head ({name}={value}); the chunked head "
                                      "does not apply it")
    softcap = getattr(config, "final_logit_softcapping", None)
    return float(softcap) if softcap else None


def decoder_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   **kwargs: Any) -> torch.Tensor:
    """The backbone's last hidden state [B, S, H] (after its final norm), computing no logits: the decoder
    (`model.get_decoder()`, LlamaForCausalLM's `model.model`) runs alone, without a KV cache."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise TypeError(f"{type(model).__name__} exposes no decoder apart from its head: get_decoder() gave "
                        f"{type(decoder).__name__}")
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    hidden: torch.Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def causal_lm_logprobs(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                       attention_mask: torch.Tensor | None = None, **options: Any) -> HeadOutput:
    """`token_logprobs` over a transformers causal LM: what `log_softmax(model(input_ids).logits).gather(targets)`
    gives, per position [B, S] (targets already shifted, -100 where ignored), without the full logits.
    `options` go to token_logprobs (soft_targets, topk, entropy, low_rank, chunk_size, row_chunk)."""
    hidden = decoder_hidden(model, input_ids, attention_mask)
    weight, bias, softcap = output_head(model)
    return token_logprobs(hidden, weight, targets, bias, softcap=softcap, **options)
