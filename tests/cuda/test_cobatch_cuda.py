"""Co-batching on CUDA: four different runs trained in shared ticks equal each run trained alone.

The base computes in bf16 there, and a run's rows sit in a batch of another shape when co-batched, so cuBLAS may
sum in another order: losses and gradients agree to bf16's precision (COBATCH_REL of the tensor's scale), not
bitwise. The LoRA matrices and AdamW stay fp32. After the steps the weights are compared through the loss they give,
not elementwise: AdamW moves an element whose gradient is near zero by the full learning rate in the direction of
that gradient's sign, which bf16 rounding can flip, so such an element differs by up to 2 × lr (measured with a bf16
base on CPU: gradients within 2% of their scale, weights elementwise 98% off, both models' losses alike)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.cuda.cuda_tools import assert_close_to_scale, base_entry, grads, requires_cuda
from tests.gpu_runtime.test_cobatch import BATCHES, LEARNING_RATES, RUNS
from tests.helpers.engine_tools import result_of, submit

pytestmark = requires_cuda
LOSS_REL = 1e-3  # a mean over tokens averages bf16 rounding down: 5e-5 with a bf16 base on CPU
COBATCH_REL = 5e-2  # gradients, as a fraction of each tensor's scale: 2e-2 with a bf16 base on CPU


def engine_with_runs(path: Path, model: str, runs: list[str]) -> Engine:
    engine = Engine(path, device="cuda")
    for run_id in runs:
        user, lora, seed = RUNS[run_id]
        engine.create_run(run_id, user, model, lora, seed=seed)
    return engine


def test_the_engine_computes_on_the_gpu_in_bf16(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = engine_with_runs(tmp_path, tiny_model_dir, ["a"])
    entry = base_entry(engine, "a")
    assert engine.device.type == "cuda"
    assert next(entry.model.parameters()).device.type == "cuda"
    assert {p.dtype for p in entry.model.parameters()} == {torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32}
    assert {(p.device.type, p.dtype) for p in engine.runs["a"].parameters()} == {("cuda", torch.float32)}


def test_cobatched_training_equals_each_run_trained_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    together = engine_with_runs(tmp_path / "together", tiny_model_dir, list(RUNS))
    losses: dict[str, list[float]] = {r: [] for r in RUNS}
    step_grads: list[dict[str, dict[str, torch.Tensor]]] = []
    for step in range(3):  # the third call's loss is the trained weights' loss
        futures = {r: submit(together, "forward_backward", run_id=r, batch=BATCHES[r]) for r in RUNS}
        assert together.tick().base_passes == 1  # the four runs' rows in one forward and backward pass
        for run_id, future in futures.items():
            losses[run_id].append(result_of(future)["loss"])
        step_grads.append({r: grads(together, r) for r in RUNS})
        if step < 2:
            steps = {r: submit(together, "optim_step", run_id=r, adam={"learning_rate": LEARNING_RATES[r]}) for r in RUNS}
            together.tick()
            assert [result_of(steps[r])["step"] for r in RUNS] == [step + 1] * 4

    for run_id in RUNS:
        alone = engine_with_runs(tmp_path / f"alone-{run_id}", tiny_model_dir, [run_id])
        for step in range(3):
            loss = alone.forward_backward(run_id, BATCHES[run_id])["loss"]
            assert loss == pytest.approx(losses[run_id][step], rel=LOSS_REL), (run_id, step)
            if step < 2:
                assert_close_to_scale(step_grads[step][run_id], grads(alone, run_id), COBATCH_REL)
                alone.optim_step(run_id, {"learning_rate": LEARNING_RATES[run_id]})
        assert losses[run_id][2] < losses[run_id][0], run_id  # the steps trained it
