"""AdamW on CUDA against the CPU reference: the same gradients give the same steps.

The engine's optim_step on a CUDA run (torch's fused AdamW kernel, which gpu_runtime/compute/optimizer.py picks
there) is replayed on the CPU with torch's single-tensor AdamW, from the same state, through the same
`adamw_step` (normaliser, clipping, settings). Both hold fp32 parameters
and see bitwise-equal gradients, so they differ only by the kernels' rounding: within ADAM_REL of the
update's own size per element."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gpu_runtime.compute.training import adamw_step
from gpu_runtime.engine.engine import Engine
from tests.cuda.cuda_tools import requires_cuda
from tests.helpers.engine_tools import BATCH

pytestmark = requires_cuda
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1, "grad_clip_norm": 1.0}
ADAM_REL = 1e-4  # of the learning rate: fp32 kernels' rounding of m / (sqrt(v) + eps), far below one step's size


def cpu_reference(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """CPU copies of the run's parameters, gradients and AdamW state, under the portable single-tensor kernel."""
    copies = [torch.nn.Parameter(p.detach().cpu().clone()) for p in params]
    for twin, param in zip(copies, params):
        twin.grad = None if param.grad is None else param.grad.detach().cpu().clone()
    reference = torch.optim.AdamW(copies, lr=ADAM["learning_rate"], foreach=False, fused=False)
    state = copy.deepcopy(optimizer.state_dict())  # load_state_dict keeps tensors already on the right device
    if state["state"]:
        reference.load_state_dict(state)  # moves the state to the copies' device (CPU)
        for group in reference.param_groups:
            group["foreach"], group["fused"] = False, False  # load_state_dict puts the saved kernel choice back
    return copies, reference


def test_optim_steps_on_cuda_match_the_cpu_reference(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cuda")
    engine.create_run("r", "u", tiny_model_dir, {"r": 8, "alpha": 16}, seed=5)
    state = engine.runs["r"]
    assert [group["fused"] for group in state.optimizer.param_groups] == [True]
    for step in range(3):
        engine.forward_backward("r", BATCH)
        copies, reference = cpu_reference(state.parameters(), state.optimizer)
        expected_norm = adamw_step(copies, reference, state.pending.normaliser, ADAM)
        before = [p.detach().cpu().clone() for p in state.parameters()]
        result = engine.optim_step("r", ADAM)
        assert result["step"] == step + 1
        assert result["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
        for param, twin, old in zip(state.parameters(), copies, before):
            got = param.detach().cpu()
            assert (got - twin.detach()).abs().max().item() <= ADAM_REL * ADAM["learning_rate"]
            assert not torch.equal(got, old) or not old.any()  # it moved (B starts at 0; A's first grads are 0)


def test_torch_fused_adamw_on_cuda_matches_the_cpu_reference() -> None:
    # The fused kernel itself, on LoRA-shaped fp32 tensors: the one gpu_runtime/compute/optimizer.py picks on CUDA.
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 64), (128, 8), (8, 128), (64, 8)] * 4
    initial = [torch.randn(shape, generator=generator) * 0.1 for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(4)]
    results = {}
    for device, kernel in (("cpu", {"foreach": False, "fused": False}), ("cuda", {"fused": True})):
        # A copy on both sides: t.to("cpu") would be t itself, and the CPU steps would move the CUDA side's start.
        params = [torch.nn.Parameter(t.to(device, copy=True)) for t in initial]
        optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, **kernel)
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.to(device)
            optimizer.step()
        results[device] = [p.detach().cpu() for p in params]
    for got, expected in zip(results["cuda"], results["cpu"]):
        assert (got - expected).abs().max().item() <= ADAM_REL * 1e-2 * len(grads)

