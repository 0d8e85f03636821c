"""Soft targets (compute/soft_targets.py): cross_entropy with (N, K) target_tokens and weights trains as the sum of K
1-D datums would, co-batched with 1-D datums, and survives the journal (docs/LOSSES.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.compute.batches import Datum
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput
from tests.gpu_runtime.test_losses import applied_grads, make_engine
from tests.helpers.engine_tools import assert_relatively_close, result_of, submit

MODEL_INPUT = [11, 52, 93, 140, 201, 305]
TARGETS = [[52, 7, 300], [93, 8, 0], [140, 9, 301], [201, 10, 0], [305, 11, 302], [400, 12, 0]]  # K = 3
WEIGHTS = [[0.7, 0.2, 0.1], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.9, 0.1, 0.0]]


def soft_datum() -> dict[str, Any]:
    return {"model_input": MODEL_INPUT, "loss_fn_inputs": {"target_tokens": TARGETS, "weights": WEIGHTS}}


def column(k: int) -> dict[str, Any]:
    """The soft datum's k-th target as a 1-D datum: the K of them sum to the soft one's loss and gradient."""
    return {"model_input": MODEL_INPUT, "loss_fn_inputs": {"target_tokens": [row[k] for row in TARGETS],
                                                           "weights": [row[k] for row in WEIGHTS]}}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_soft_datum_trains_as_its_k_columns_together(tmp_path: Path, tiny_model_dir: str, reduction: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"soft": 4, "columns": 4})  # the same seed: the same weights
    soft = engine.forward_backward("soft", [soft_datum()], loss_fn="cross_entropy", reduction=reduction,
                                   return_outputs=True)
    hard = engine.forward_backward("columns", [column(k) for k in range(3)], loss_fn="cross_entropy",
                                   reduction=reduction)
    assert soft["loss"] == pytest.approx(hard["loss"], rel=1e-5)  # mean: both divide by the weight mass, 6.0
    got, expected = applied_grads(engine, "soft"), applied_grads(engine, "columns")
    assert got.keys() == expected.keys()
    for name in got:
        assert_relatively_close(got[name], expected[name], name=name)
    (output,) = soft["outputs"]
    assert len(output["logprobs"]) == len(MODEL_INPUT)  # each position's first target's logprob
    total = sum(output["elementwise_loss"])
    assert (total if reduction == "sum" else total / 6.0) == pytest.approx(soft["loss"], rel=1e-5)


def test_a_soft_datum_shares_a_pass_with_other_runs_datums_as_if_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    batches = {"a": [soft_datum()], "b": [column(0)]}
    together = make_engine(tmp_path / "together", tiny_model_dir, {"a": 4, "b": 5})
    futures = {run_id: submit(together, "forward_backward", run_id=run_id, batch=batch, loss_fn="cross_entropy",
                              reduction="sum") for run_id, batch in batches.items()}
    assert together.tick().base_passes == 1
    for run_id, batch in batches.items():
        alone = make_engine(tmp_path / f"alone-{run_id}", tiny_model_dir, {run_id: {"a": 4, "b": 5}[run_id]})
        expected = alone.forward_backward(run_id, batch, loss_fn="cross_entropy", reduction="sum")
        assert result_of(futures[run_id])["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        grads_alone = applied_grads(alone, run_id)
        for name, grad in applied_grads(together, run_id).items():
            assert_relatively_close(grad, grads_alone[name], name=f"{run_id} {name}")


def test_the_journal_keeps_the_soft_shape() -> None:
    datum = Datum.from_record(soft_datum())
    assert datum.soft is not None and datum.targets == [row[0] for row in TARGETS]
    assert datum.weights == pytest.approx([1.0] * 6)  # each position's weight mass
    assert datum.to_dict() == soft_datum()


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "gspo", "stable_reinforce"])
def test_soft_targets_are_cross_entropys_alone(engine: Engine, tiny_run: str, loss_fn: str) -> None:
    bad = {"model_input": MODEL_INPUT, "loss_fn_inputs": {"target_tokens": TARGETS, "weights": WEIGHTS,
                                                          "advantages": [1.0] * 6, "logprobs": [-1.0] * 6}}
    with pytest.raises(BadInput) as caught:
        engine.forward_backward(tiny_run, [bad], loss_fn=loss_fn)
    assert caught.value.field == "batch[0].loss_fn_inputs.target_tokens"
    assert torch.is_grad_enabled()
