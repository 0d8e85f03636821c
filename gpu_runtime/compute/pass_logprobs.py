"""A pass's per-position target logprobs: through the chunked loss head (loss_head.py), so the model's full
[tokens, vocabulary] logits are never built, wherever the model's head allows; else through the model's own logits.

The head is taken when the output projection is a plain Linear, or a multi-LoRA wrapper none of this pass's runs has
an adapter on (its base Linear then computes the same). The model's own logits are kept (the fallback) for a pass
where a run trains the unembedding (`train_unembed`: its rows' deltas are the wrapper's), for a head that is not a
Linear (quantized), for logit scalings the chunked head does not apply, and in a sharded pool (FSDP gathers the
head's weight around the model's own forward).

Selective activation checkpointing is here too: `checkpointed(model, layers)` recomputes the given decoder layers in
backward instead of keeping their activations (memory_fit.py says how many a pass needs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpu_runtime.compute.batches import Collated
from gpu_runtime.compute.joined_rows import MASKED_IMPLEMENTATIONS, JoinedRows, implementation_mask, windowed
from gpu_runtime.compute.lora.layer import MultiLoraLinear, Segment
from gpu_runtime.compute.loss_head import decoder_hidden, logit_softcap, token_logprobs
from gpu_runtime.compute.losses import soft_target_logprobs, target_logprobs


def plain_head(model: nn.Module, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None, float | None] | None:
    """(weight, bias, softcap) of the output projection when the chunked head computes what the model would; else None."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, MultiLoraLinear):
        lora = head.lora
        if lora is not None and any(lora.holds(head.routing.slot_of(segment.key)) for segment in segments):
            return None  # a run's unembedding delta: the wrapper adds it per row (a LowRank per run is not wired yet)
        head = head.base_layer
    if type(head) is not nn.Linear:  # exact type: a quantized or otherwise altered projection computes differently
        return None
    try:
        softcap = logit_softcap(model)
    except NotImplementedError:
        return None
    return head.weight, head.bias, softcap


def pass_logprobs(model: nn.Module, data: Collated, segments: list[Segment], sharded: bool = False,
                  joined: JoinedRows | None = None) -> torch.Tensor:
    """log p(targets[b, t]) [B, T] fp32 for the collated rows, under the routing already set for `segments`; a soft
    row's position holds Σ_k w_k·log p(t_k) instead (its 1-D target is ignored, so the two add without a select).
    `joined`: the model runs on these rows instead (the segments name them), gathered back to [B, T]."""
    head = None if sharded else plain_head(model, segments)
    if joined is None:
        ids, targets, soft_targets, soft_weights = data.input_ids, data.targets, data.soft_targets, data.soft_weights
        mask, positions = attention_mask(model, data), {}
    else:
        ids, targets, soft_targets, soft_weights = joined.input_ids, joined.targets, joined.soft_targets, joined.soft_weights
        mask, positions = joined.mask(model), {"position_ids": joined.positions}
    if head is None:
        logits = model(input_ids=ids, attention_mask=mask, **positions).logits
        logprobs = target_logprobs(logits, targets)
        if soft_targets is not None and soft_weights is not None:
            logprobs = logprobs + soft_target_logprobs(logits, soft_targets, soft_weights)
    else:
        weight, bias, softcap = head
        hidden = decoder_hidden(model, ids, mask, **positions)
        out = token_logprobs(hidden, weight, targets, bias, softcap=softcap, soft_targets=soft_targets,
                             soft_weights=soft_weights)
        logprobs = out.logprobs if out.soft is None else out.logprobs + out.soft
    return logprobs if joined is None else joined.padded(logprobs)


def attention_mask(model: nn.Module, data: Collated) -> torch.Tensor | None:
    """The mask the model's attention needs, built from the host's row lengths so that transformers never reads one
    back to decide whether it may skip it (a sync per pass): None without padding (SDPA's causal kernel), else the
    4D causal-and-padding mask transformers would build (bool for SDPA, additive for eager), passed as it is."""
    width = data.input_ids.shape[1]
    if all(n == width for n in data.lengths):
        return None
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_IMPLEMENTATIONS or windowed(config):
        # flash and flex read the 2D mask themselves; a model with sliding-window layers builds one mask per layer
        # kind from it (one causal 4D mask would give its windowed layers full attention)
        return data.attention_mask
    positions = torch.arange(width, device=data.input_ids.device)
    allowed = (positions[None, :] <= positions[:, None])[None, None] & data.attention_mask.bool()[:, None, None, :]
    return implementation_mask(model, allowed)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder's layers in order (a transformers causal LM's `model.layers`); [] where there is no such list."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


@contextmanager
def checkpointed(model: nn.Module, count: int) -> Iterator[int]:
    """Recompute `count` of the decoder's layers in backward, spread evenly across them; yields how many were.

    Through transformers' own per-layer hook (GradientCheckpointingLayer): its flag and function are set on the
    chosen layers alone, and the layer's own `training` flag (not its children's: no dropout is switched on), which
    the hook reads. Non-reentrant checkpointing restores the RNG state, and the LoRA dropout masks are seeded, so the
    recompute draws what the forward drew; the routing must stay set until backward ends."""
    layers = [layer for layer in decoder_layers(model) if hasattr(layer, "gradient_checkpointing")]
    chosen = [layers[(i * len(layers)) // count] for i in range(min(count, len(layers)))] if count > 0 else []
    saved = [(layer.gradient_checkpointing, layer.training, getattr(layer, "_gradient_checkpointing_func", None))
             for layer in chosen]
    for layer in chosen:  # setattr: nn.Module's stub types every attribute as a tensor or a module
        setattr(layer, "gradient_checkpointing", True)  # noqa: B010
        layer.training = True
        setattr(layer, "_gradient_checkpointing_func", functools.partial(checkpoint, use_reentrant=False))  # noqa: B010
    try:
        yield len(chosen)
    finally:
        for layer, (flag, training, func) in zip(chosen, saved):
            setattr(layer, "gradient_checkpointing", flag)  # noqa: B010
            layer.training = training
            if func is None:
                delattr(layer, "_gradient_checkpointing_func")
            else:
                setattr(layer, "_gradient_checkpointing_func", func)  # noqa: B010
