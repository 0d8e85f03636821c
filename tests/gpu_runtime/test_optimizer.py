"""A run's AdamW: fused where torch has the kernel, and still fused after a snapshot's state is loaded."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gpu_runtime.compute.optimizer import fused_on, new_adamw, restore_fused
from gpu_runtime.compute.optim_tick import clip_grad_norm


def params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 8, generator=generator)), torch.nn.Parameter(torch.randn(8, 4, generator=generator))]


def step(ps: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_cpu_adamw_is_fused_and_agrees_with_the_portable_kernel() -> None:
    assert fused_on("cpu")
    ours, reference = params(), params()
    fused, plain = new_adamw(ours), torch.optim.AdamW(reference, lr=1e-4, foreach=False)
    assert fused.param_groups[0]["fused"] is True
    for seed in range(3):
        step(ours, fused, seed)
        step(reference, plain, seed)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_restored_state_steps_on_bitwise_like_the_live_optimizer() -> None:
    live, restored = params(), params()
    live_optimizer = new_adamw(live)
    step(live, live_optimizer, 0)
    saved = copy.deepcopy(live_optimizer.state_dict())  # as a snapshot holds it: not the live moments
    saved["param_groups"][0]["fused"] = None  # a snapshot written before fused AdamW
    with torch.no_grad():
        for a, b in zip(restored, live):
            a.copy_(b)
    optimizer = new_adamw(restored)
    optimizer.load_state_dict(saved)
    restore_fused(optimizer)
    assert optimizer.param_groups[0]["fused"] is True
    for seed in (1, 2):
        step(live, live_optimizer, seed)
        step(restored, optimizer, seed)
    for a, b in zip(restored, live):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("scale", "max_norm"), [(1e-3, 1.0), (1.0, 1.0), (1.0, 0.3), (1.0, math.inf)])
def test_clip_grad_norm_is_torchs_bit_for_bit(scale: float, max_norm: float) -> None:
    # On the device, no host sync: within bounds it multiplies by exactly 1.0 (no bit changes); clipped, as torch does.
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale for shape in [(32, 64), (64, 32)] * 8]
    ours = [g.clone() for g in grads]
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(reference, max_norm))
    total = clip_grad_norm(ours, max_norm)
    assert isinstance(total, torch.Tensor) and total.tolist() == expected
    assert all(p.grad is not None and torch.equal(a, p.grad) for a, p in zip(ours, reference))
    assert torch.equal(ours[0], grads[0]) == (expected <= max_norm)  # clipped exactly when over the bound
