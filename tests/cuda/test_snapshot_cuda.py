"""Snapshot then restore on CUDA: a run saved and restored in a new engine holds bitwise what it held (weights, AdamW
state, pending gradients) and takes its next step exactly as the original does; a run restored by replaying its
journal (no snapshot) recomputes its passes on the GPU, so it matches to bf16's precision instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from gpu_runtime.engine.engine import Engine
from tests.cuda.cuda_tools import assert_bitwise, grads, requires_cuda, weights
from tests.helpers.engine_tools import BATCH

pytestmark = requires_cuda
LORA = {"r": 8, "alpha": 16, "dropout": 0.1}
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.01}
# Replayed passes recompute forward_backward in bf16, so a restored run matches to bf16's rounding, which AdamW
# carries into near-zero-gradient elements at full size (tests/cuda/test_cobatch_cuda.py): compared by loss.
REPLAY_LOSS_REL = 1e-3


def optimizer_state(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    state = engine.runs[run_id].optimizer.state_dict()["state"]
    return {f"{i}.{key}": value.detach().float().cpu().clone() for i, entry in state.items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


def trained(path: Path, model: str) -> Engine:
    engine = Engine(path, device="cuda")
    engine.create_run("r", "u", model, LORA, seed=7)
    for _ in range(2):
        engine.forward_backward("r", BATCH)
        engine.optim_step("r", ADAM)
    engine.forward_backward("r", BATCH[:2])  # pending gradients: a snapshot holds them too
    return engine


def test_a_snapshot_restores_bitwise_and_steps_alike(tmp_path: Path, tiny_model_dir: str) -> None:
    first = trained(tmp_path / "first", tiny_model_dir)
    saved = first.save_state("r", "state")
    assert saved["step"] == 2
    held = (weights(first, "r"), grads(first, "r"), optimizer_state(first, "r"))
    shutil.copytree(tmp_path / "first", tmp_path / "second")  # the data directory as the snapshot left it
    first.optim_step("r", ADAM)
    stepped = weights(first, "r")

    second = Engine(tmp_path / "second", device="cuda")  # a new worker on that data directory
    info = second.run_info("r")
    assert (info["step"], info["pending_forward_backward"]) == (2, 1)
    assert_bitwise(weights(second, "r"), held[0])
    assert_bitwise(grads(second, "r"), held[1])
    assert_bitwise(optimizer_state(second, "r"), held[2])
    assert {p.device.type for p in second.runs["r"].parameters()} == {"cuda"}
    # load_state_dict put back the saved groups' kernel choice; the restore sets the fused kernel again.
    assert [group["fused"] for group in second.runs["r"].optimizer.param_groups] == [True]
    second.optim_step("r", ADAM)  # from bitwise-equal state and gradients, the same step
    assert_bitwise(weights(second, "r"), stepped)


def test_a_run_restored_from_its_journal_continues_as_the_original(tmp_path: Path, tiny_model_dir: str) -> None:
    first = trained(tmp_path / "first", tiny_model_dir)
    first.optim_step("r", ADAM)
    shutil.copytree(tmp_path / "first", tmp_path / "second")  # no snapshot in it: restoring replays the journal
    expected_loss = first.forward_backward("r", BATCH)["loss"]
    first_weights = weights(first, "r")

    second = Engine(tmp_path / "second", device="cuda")
    assert second.run_info("r")["step"] == 3
    loss = second.forward_backward("r", BATCH)["loss"]
    assert abs(loss - expected_loss) <= REPLAY_LOSS_REL * abs(expected_loss)
    restored = weights(second, "r")
    assert restored.keys() == first_weights.keys()
    assert all(torch.isfinite(t).all() for t in restored.values())
