"""A run's AdamW: fused where torch has the kernel, and still fused after a snapshot's state is loaded."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gpu_runtime.compute.optim_tick import StepOrder, clip_grad_norm, optimizer_tick
from gpu_runtime.compute.optimizer import fused_on, new_adamw, restore_fused


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


def settings(lr: float, clip: float) -> dict[str, float]:
    return {"learning_rate": lr, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1, "grad_clip_norm": clip}


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_one_optimizer_tick_steps_each_run_bit_for_bit_as_its_own_fused_step(clip: float) -> None:
    """Three runs (two sharing settings: one fused call; one with its own learning rate) in one tick equal each run
    divided, clipped (torch's clip_grad_norm_) and stepped by its own fused AdamW, over three ticks."""
    runs = [params() for _ in range(3)]
    twins = [[torch.nn.Parameter(p.detach().clone()) for p in run] for run in runs]
    optimizers, references = [new_adamw(run) for run in runs], [new_adamw(run) for run in twins]
    lrs, normalisers = [1e-2, 1e-2, 3e-3], [4.0, 7.0, 1.0]
    for tick in range(3):
        generator = torch.Generator().manual_seed(tick)
        for run, twin in zip(runs, twins):
            for p, q in zip(run, twin):
                p.grad = torch.randn(p.shape, generator=generator) * 3
                q.grad = p.grad.clone()
        norms = optimizer_tick([StepOrder(run, opt, n, settings(lr, clip))
                                for run, opt, n, lr in zip(runs, optimizers, normalisers, lrs)])
        for twin, opt, n, lr, norm in zip(twins, references, normalisers, lrs, norms):
            for q in twin:
                assert q.grad is not None
                q.grad.div_(n)
            expected = torch.nn.utils.clip_grad_norm_(twin, clip or math.inf)
            for group in opt.param_groups:
                group["lr"], group["betas"], group["weight_decay"] = lr, (0.9, 0.99), 0.1
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert norm == float(expected)
    for run, twin in zip(runs, twins):
        assert all(torch.equal(p, q) for p, q in zip(run, twin))
        assert all(p.grad is None for p in run)


def test_a_run_whose_norm_is_not_finite_is_left_out_of_the_tick_and_loses_its_gradients() -> None:
    healthy, poisoned = params(), params()
    before = [p.detach().clone() for p in poisoned]
    for p in healthy + poisoned:
        p.grad = torch.ones_like(p)
    poisoned[0].grad = torch.full_like(poisoned[0], math.nan)
    norms = optimizer_tick([StepOrder(healthy, new_adamw(healthy), 1.0, settings(1e-2, 1.0)),
                            StepOrder(poisoned, new_adamw(poisoned), 1.0, settings(1e-2, 1.0))])
    assert math.isfinite(norms[0]) and math.isnan(norms[1])
    assert all(torch.equal(p, b) for p, b in zip(poisoned, before))
    assert all(p.grad is None for p in healthy + poisoned)
