"""Quantized bases through bitsandbytes: 8-bit (LLM.int8) and 4-bit QLoRA-style (NF4, double quantization).

A quantized base is its own pool entry (`base_key`), so its runs co-batch with each other and never
with the same model in full precision. Every Linear but the output head is swapped for bitsandbytes'
`Linear8bitLt` / `Linear4bit`; the weights are quantized as the modules move to the device, so the
full-precision copy of each layer is dropped as soon as its quantized one exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from gpu_runtime.client.allocation import QUANTIZATIONS, parse_quantization
from gpu_runtime.errors import BadInput, FailedPrecondition

BNB_VERSION = "0.50.2"  # pinned in pyproject.toml; the Modal image pins the same


def base_key(base_model: str, quantization: str | None) -> str:
    """The pool entry a run trains on: the model name, plus its quantization when it has one."""
    return f"{base_model}#{quantization}" if quantization else base_model


def checked(quantization: Any) -> str | None:
    """The request's quantization, validated (a typed error naming the field, never an AttributeError)."""
    if quantization is not None and not isinstance(quantization, str):
        raise BadInput(f"quantization must be a string ({' or '.join(QUANTIZATIONS)}), got {quantization!r}",
                       field="quantization")
    return parse_quantization(quantization)


def bitsandbytes() -> Any:
    """The bitsandbytes module, or a clear refusal where it cannot run (not installed, or no backend here)."""
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # noqa: BLE001 - an import failure of any kind means quantization is unavailable
        raise FailedPrecondition(
            f"quantization needs bitsandbytes=={BNB_VERSION}, which cannot be loaded here ({type(exc).__name__}: {exc}); "
            "install it, or create the run without quantization", field="quantization") from None
    return bnb


def quantize_model(model: nn.Module, quantization: str, device: torch.device, compute_dtype: torch.dtype) -> int:
    """Swap each Linear (not lm_head) for its bitsandbytes twin on `device`; returns how many were swapped."""
    bnb = bitsandbytes()
    swapped = 0
    for path, linear in list(_linears(model)):
        if quantization == "4bit":
            # QLoRA's recipe: NF4 with double quantization of the scales, computing in bf16 (fp32 on a fp32 base).
            q: Any = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                             compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                             device="meta")
            q.weight = bnb.nn.Params4bit(linear.weight.data.to("cpu"), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)
            # On CPUs with AVX512-BF16, bitsandbytes repacks a weight for a bf16 kernel on its first no-grad pass,
            # and every later pass (training too) then computes in bf16: off, so compute_dtype means what it says.
            q.support_avx512bf16_for_cpu = False
        else:
            # threshold 0: no fp16 outlier columns, so every weight is int8 and the memory saving is the full 2x.
            q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=0.0, device="meta")
            q.weight = bnb.nn.Int8Params(linear.weight.data.to("cpu"), requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        parent, leaf = _parent(model, path)
        setattr(parent, leaf, q.to(device))  # the move is what quantizes
        swapped += 1
    # The flags transformers sets when it quantizes at load: PEFT reads them to pick its bitsandbytes LoRA.
    setattr(model, "is_loaded_in_8bit", quantization == "8bit")  # noqa: B010 - a plain Module declares neither
    setattr(model, "is_loaded_in_4bit", quantization == "4bit")  # noqa: B010
    return swapped


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for path, module in model.named_modules():
        if type(module) is nn.Linear and not path.endswith("lm_head"):  # exact type: never re-quantize
            yield path, module


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    if "." not in path:
        return model, path
    head, leaf = path.rsplit(".", 1)
    return model.get_submodule(head), leaf


def quantization_of(module: nn.Module) -> str | None:
    """"4bit" / "8bit" for a bitsandbytes Linear, None for anything else."""
    kind = type(module).__name__
    return {"Linear4bit": "4bit", "Linear8bitLt": "8bit"}.get(kind)


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The fp32 [out, in] weight a bitsandbytes Linear computes with (a plain Linear's own weight)."""
    kind = quantization_of(module)
    weight: Any = module.weight  # Params4bit / Int8Params carry their quantization state as attributes
    if kind == "4bit":
        bnb = bitsandbytes()
        return cast(torch.Tensor, bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float())
    if kind == "8bit":
        scales = weight.SCB if getattr(weight, "SCB", None) is not None else cast(Any, module).state.SCB
        return cast(torch.Tensor, weight.data.float() * (scales.float().unsqueeze(1) / 127.0))
    return cast(torch.Tensor, weight.detach().float())


def count_quantized(model: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for module in model.modules():
        kind = quantization_of(module)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def require_quantizable(quantization: str | None, device: torch.device) -> None:
    """Refuse early, naming the field, where bitsandbytes has no backend for this device."""
    if quantization is None:
        return
    bitsandbytes()
    if device.type not in ("cpu", "cuda"):
        raise FailedPrecondition(f"bitsandbytes cannot quantize on device {device.type!r} (cpu or cuda only)",
                                 field="quantization")
