"""Which device and dtype the engine computes on."""

from __future__ import annotations

import torch

from gpu_runtime.errors import BadInput


def resolve_device(spec: str = "auto") -> tuple[torch.device, torch.dtype]:
    """"auto" → CUDA when present (bf16 where supported), else CPU in fp32; or an explicit device."""
    if not isinstance(spec, str) or not spec:
        raise BadInput(f"device must be a string like 'auto', 'cpu' or 'cuda:1', got {spec!r}", field="device")
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise BadInput(f"unknown device {spec!r}: {exc}", field="device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"device {spec!r} requested but CUDA is not available here", field="device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BadInput(f"device {spec!r} does not exist ({torch.cuda.device_count()} GPUs)", field="device")
        # bf16 keeps fp32's range, so LoRA training needs no loss scaling.
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return device, dtype
    if device.type != "cpu":
        raise BadInput(f"unsupported device {spec!r}; use 'auto', 'cpu' or 'cuda[:N]'", field="device")
    return device, torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
