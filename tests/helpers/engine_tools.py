"""Reading an Engine's internals in tests: a run's LoRA weights and its logits; submitting calls without ticking."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from gpu_runtime.compute.lora.layer import Segment, routed
from gpu_runtime.engine.engine import Engine

BATCH: list[dict[str, Any]] = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"input": "Q: What is 2 + 2?\nA:", "output": " 4"},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]},
    {"tokens": [28120, 905, 314, 260, 3575, 282], "weights": [0, 1, 1, 1, 1, 1]},
]


def lora_weights(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    """The run's LoRA tensors, named without the adapter key so two runs compare by name."""
    engine.run_info(run_id)  # restores it if it was evicted
    return {name: p.detach().clone() for name, p in engine.runs[run_id].named_parameters().items()}


# fp32 sums of the same terms in another order (another batch shape, a co-batched pass): within 1e-5 of scale on
# AVX2 CPUs, up to 1.7e-5 measured on an AVX-512 EPYC, whose kernels split the reductions differently.
FP32_REL = 5e-5


def assert_relatively_close(got: torch.Tensor, expected: torch.Tensor, rel: float = FP32_REL, name: str = "") -> None:
    """Within `rel` of the tensor's scale: fp32 sums in another order differ by ~1e-7 of the largest term,
    which elementwise tolerances call a failure wherever an element is near zero."""
    scale = expected.abs().max().item()
    error = (got - expected).abs().max().item()
    assert error <= rel * scale, f"{name}: max error {error:.3g} is {error / max(scale, 1e-30):.3g} of the scale {scale:.3g}"


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True,
                        rel: float = FP32_REL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            assert_relatively_close(a[name], b[name], rel, name=name)


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = FP32_REL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert_relatively_close(a[name], b[name], rel, name=name)


def run_logits(engine: Engine, run_id: str, input_ids: list[int]) -> torch.Tensor:
    """Logits of `run_id`'s current weights (eval mode, no grad)."""
    engine.run_info(run_id)
    entry = engine.residency.bases[engine.runs[run_id].base_key]
    with torch.no_grad(), routed(entry.routing, [Segment(run_id, 0, 1)]):
        return entry.model(input_ids=torch.tensor([input_ids])).logits[0].float()


def train(engine: Engine, run_id: str, steps: int, batch: list[dict[str, Any]] | None = None, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(engine.forward_backward(run_id, batch or BATCH)["loss"])
        engine.optim_step(run_id, {"learning_rate": lr})
    return losses


def submit(engine: Engine, method: str, **params: Any) -> Future[dict[str, Any]]:
    """Queue a call without running a tick; the future holds the runtime's message."""
    future: Future[dict[str, Any]] = Future()
    engine.submit_message(method, params, future.set_result)
    return future


def result_of(future: Future[dict[str, Any]]) -> dict[str, Any]:
    """The result of an answered call (asserting it was not an error)."""
    message = future.result(timeout=0)
    assert "result" in message, message
    return message["result"]
