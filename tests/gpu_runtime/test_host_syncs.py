"""No host sync inside a pass or an optimizer tick (issue 30): a co-batched forward_backward pass reads the device
back once, at its end, and an optimizer tick over several runs once. Counted on the CPU with a TorchFunctionMode that
sees every `.item()`, `.tolist()`, `.cpu()`, `float()`/`bool()`/`int()` of a tensor and `nonzero`, which on a GPU
would each wait for the device."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from gpu_runtime.compute import pass_logprobs
from gpu_runtime.compute.batches import Datum
from gpu_runtime.compute.memory_fit import layers_to_checkpoint
from gpu_runtime.compute.optim_tick import StepOrder, optimizer_tick
from gpu_runtime.compute.plan import PartOutcome, PassPart
from gpu_runtime.compute.training import forward_backward_pass
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__float__,
         torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}
RANKS = (2, 4, 8)


class CountSyncs(TorchFunctionMode):
    """Counts the calls that copy a tensor's value to the host, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNCS:
            self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@pytest.fixture
def engine_with_runs(tmp_path: Path, tiny_model_dir: str) -> Engine:
    engine = Engine(tmp_path / "data", device="cpu")
    for i, r in enumerate(RANKS):
        engine.create_run(f"run-{i}", f"user-{i}", tiny_model_dir, {"r": r, "alpha": 2 * r, "dropout": 0.1}, seed=i)
    return engine


def parts(loss_fn: str = "cross_entropy", return_outputs: bool = False, nan_in: int | None = None) -> list[PassPart]:
    """One call per run, of rows of different lengths; `nan_in`: that run's advantages overflow its loss to inf."""
    made = []
    for i in range(len(RANKS)):
        rows = [Datum([5 + j + k for k in range(4 + 3 * j)], [6 + j + k for k in range(4 + 3 * j)],
                      [0.5] * (4 + 3 * j)) for j in range(i + 1)]
        if loss_fn == "importance_sampling":
            for row in rows:
                n = row.length
                row.inputs = {"advantages": [1e38 if i == nan_in else 1.0] * n, "logprobs": [-80.0 if i == nan_in else -1.0] * n}
        made.append(PassPart(f"run-{i}", rows, 0, call_rows=len(rows), call_width=max(r.length for r in rows),
                             dropout_seed=100 + i, loss_fn=loss_fn, return_outputs=return_outputs))
    return made


@pytest.mark.parametrize(("return_outputs", "slotted"), [(False, True), (True, False)],
                         ids=["slotted-tick", "torch-kernels-tick-with-outputs"])
def test_a_cobatched_pass_and_an_optimizer_tick_each_copy_to_the_host_once(engine_with_runs: Engine,
                                                                           return_outputs: bool, slotted: bool) -> None:
    engine = engine_with_runs
    entry, runs = engine.residency.bases[engine.runs["run-0"].base_key], engine.residency.runs
    with CountSyncs() as during_pass:
        outcomes = forward_backward_pass(entry, runs, parts(return_outputs=return_outputs), torch.device("cpu"))
    assert during_pass.total == 1, during_pass.counts
    assert all(isinstance(o, PartOutcome) and o.loss_sum > 0 for o in outcomes)
    if return_outputs:
        assert [len(o.outputs or []) for o in outcomes if isinstance(o, PartOutcome)] == [1, 2, 3]
    assert all(p.grad is not None for run in runs.values() for p in run.parameters() if p.shape[0] > 0)
    orders = [StepOrder(run.parameters(), run.optimizer, 10.0, {"learning_rate": 1e-3 * (1 + i % 2), "beta1": 0.9,
                                                                 "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                                                                 "grad_clip_norm": 1.0},
                        slots=entry.routing.slots if slotted else None, key=run.run_id)
              for i, run in enumerate(runs.values())]
    before = [[p.detach().clone() for p in run.parameters()] for run in runs.values()]
    with CountSyncs() as during_tick:
        norms = optimizer_tick(orders)
    assert during_tick.total == 1, during_tick.counts
    assert len(norms) == len(RANKS) and all(n > 0 for n in norms)
    for run, old in zip(runs.values(), before):
        assert any(not torch.equal(p, o) for p, o in zip(run.parameters(), old))  # every run stepped
        assert all(p.grad is None for p in run.parameters())


def test_a_part_whose_loss_is_not_finite_adds_nothing_to_any_gradient_without_a_sync(engine_with_runs: Engine) -> None:
    engine = engine_with_runs
    entry, runs = engine.residency.bases[engine.runs["run-0"].base_key], engine.residency.runs
    with CountSyncs() as counted:
        outcomes = forward_backward_pass(entry, runs, parts("importance_sampling", nan_in=1), torch.device("cpu"))
    assert counted.total == 1, counted.counts
    assert isinstance(outcomes[1], BadInput) and "loss is" in outcomes[1].message
    assert isinstance(outcomes[0], PartOutcome) and isinstance(outcomes[2], PartOutcome)
    poisoned = [p.grad for p in runs["run-1"].parameters()]
    assert all(g is None or torch.equal(g, torch.zeros_like(g)) for g in poisoned)
    for run_id in ("run-0", "run-2"):
        grads = [p.grad for p in runs[run_id].parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_recomputing_layers_in_backward_gives_the_same_losses_and_gradients(engine_with_runs: Engine,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Selective activation checkpointing (what a pass that would not fit the GPU turns on): the same loss sums and
    the same gradients, dropout included (its masks are seeded), bit for bit on the CPU."""
    engine = engine_with_runs
    checkpointed: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        checkpointed.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(pass_logprobs, "checkpoint", counted)
    entry, runs = engine.residency.bases[engine.runs["run-0"].base_key], engine.residency.runs
    results = []
    for layers in (0, 1, 2):
        for run in runs.values():
            run.optimizer.zero_grad(set_to_none=True)
        checkpointed.clear()
        outcomes = forward_backward_pass(entry, runs, parts(), torch.device("cpu"), checkpoint_layers=layers)
        assert len(checkpointed) == layers  # the tiny model has 2 decoder layers: each chosen one recomputed
        grads = {f"{run_id}.{i}": p.grad.clone() for run_id, run in runs.items()
                 for i, p in enumerate(run.parameters()) if p.grad is not None}
        results.append(([o.loss_sum for o in outcomes if isinstance(o, PartOutcome)], grads))
    for sums, grads in results[1:]:
        assert sums == results[0][0]
        assert grads.keys() == results[0][1].keys() and all(torch.equal(g, results[0][1][k]) for k, g in grads.items())
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in entry.model.get_decoder().layers)


@pytest.mark.parametrize(("tokens", "free_gib", "expected"), [(1024, 80, 0), (8192, 80, 1), (8192, 8, 30), (8192, 0, 32)])
def test_an_8b_shaped_pass_checkpoints_the_fewest_layers_that_fit(tokens: int, free_gib: int, expected: int) -> None:
    """Llama-3.1-8B's shape in bf16: 8 x 1024 tokens keep ~55 GB of activations, past 0.8 of an 80 GB GPU's free
    memory less its 16 GB of weights: one of its 32 layers is recomputed, nearly all where 8 GB are free."""
    per_token = ((12 * 4096 + 4 * 14336) * 2, 4096 * 2)
    assert layers_to_checkpoint(32, tokens, per_token, free_gib * 1024**3 - 16 * 1024**3 * (free_gib > 16)) == expected
