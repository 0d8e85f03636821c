"""Reading a CUDA Engine's runs in tests: weights, gradients and teacher-forced logprobs, moved to the CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from gpu_runtime.compute.lora.layer import Segment, routed
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.engine.engine import Engine

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh runs these)")


@pytest.fixture
def compiled_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """choose() left to pick (Triton on CUDA), and fp32 references in full fp32 (TF32 off). Files whose checks are
    of the compiled kernels use it autouse (`pytestmark = pytest.mark.usefixtures("compiled_triton")`)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: these check the compiled kernels")
    monkeypatch.delenv("SIGNAL_LORA_KERNELS", raising=False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    yield


def base_entry(engine: Engine, run_id: str) -> BaseEntry:
    """The loaded base a resident run trains on (a quantized base is an entry of its own)."""
    return engine.residency.bases[engine.runs[run_id].base_key]


def weights(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    engine.run_info(run_id)  # restores it if it was evicted
    return {name: p.detach().float().cpu().clone() for name, p in engine.runs[run_id].named_parameters().items()}


def grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    named = engine.runs[run_id].named_parameters().items()
    return {name: p.grad.detach().float().cpu().clone() for name, p in named if p.grad is not None}


def scaled_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference as a fraction of the expected tensor's largest magnitude (elementwise tolerances fail
    wherever an element is near zero; this one reads as 'digits of the tensor's scale')."""
    scale = expected.abs().max().item()
    return (got - expected).abs().max().item() / max(scale, 1e-30)


def assert_close_to_scale(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float) -> None:
    assert got.keys() == expected.keys()
    worst = max(((scaled_error(got[n], expected[n]), n) for n in got), default=(0.0, ""))
    assert worst[0] <= rel, f"{worst[1]}: off by {worst[0]:.3g} of its scale (allowed {rel})"


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    differing = [name for name in got if not torch.equal(got[name], expected[name])]
    assert not differing, f"{len(differing)} tensors differ, first {differing[0]}"


def teacher_forced_logprobs(engine: Engine, run_id: str, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The run's logprob of each continuation token after the prompt and the tokens before it (one unpadded pass)."""
    engine.run_info(run_id)
    entry = base_entry(engine, run_id)
    ids = torch.tensor([prompt + continuation], device=engine.device)
    with torch.no_grad(), routed(entry.routing, [Segment(run_id, 0, 1)]):
        logits = entry.model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return logprobs[torch.arange(len(continuation), device=logprobs.device), torch.tensor(continuation, device=logprobs.device)].cpu()
