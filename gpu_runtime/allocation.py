"""GPU allocation rules: which GPUs a run gets from its model size, or from the user's `gpu_config`.

Pure Python (no torch): the server validates `gpu_config` with it and the Modal launcher uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.errors import BadInput

GPU_TYPES: dict[str, int] = {"T4": 16, "A10G": 24, "L40S": 48, "A100": 40, "A100-80GB": 80, "H100": 80}
MAX_GPUS = 8

_BILLION = 1_000_000_000


@dataclass(frozen=True)
class GpuAllocation:
    gpu_type: str
    count: int

    def __str__(self) -> str:
        return f"{self.gpu_type}:{self.count}"


def parse_gpu_config(value: str, field: str = "gpu_config") -> GpuAllocation:
    """Parse "L40S", "L40S:2", "a100-80gb:4" (case-insensitive) into an allocation."""
    gpu_type, _, count_text = value.strip().partition(":")
    canonical = {name.upper(): name for name in GPU_TYPES}.get(gpu_type.upper())
    if canonical is None:
        raise BadInput(f"unknown GPU type {gpu_type!r}; use one of {', '.join(GPU_TYPES)}", field=field)
    try:
        count = int(count_text) if count_text else 1
    except ValueError:
        raise BadInput(f"GPU count must be an integer, got {count_text!r}", field=field) from None
    if not 1 <= count <= MAX_GPUS:
        raise BadInput(f"GPU count must be between 1 and {MAX_GPUS}, got {count}", field=field)
    return GpuAllocation(canonical, count)


def allocate(parameters: int) -> GpuAllocation:
    """The product README's rules, by parameter count."""
    if parameters < 7 * _BILLION:
        return GpuAllocation("L40S", 1)
    if parameters < 13 * _BILLION:
        return GpuAllocation("A100-80GB", 1)
    if parameters < 30 * _BILLION:
        return GpuAllocation("A100-80GB", 2)
    if parameters < 72 * _BILLION:  # "70B" models are 70.6B
        return GpuAllocation("A100-80GB", 4)
    return GpuAllocation("A100-80GB", 8)
