"""cross_entropy with (N, K) soft targets (a teacher's top-K, off-policy distillation): loss = -Σ_k w_k·log p(t_k) per
position, through the fused loss head in the same pass as other runs' hard targets, against a PEFT fp32 reference
computed from the model's full logits; and the datum's checks, each naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from gpu_runtime.compute.batches import IGNORED, Datum
from gpu_runtime.compute.loss_head import token_logprobs
from gpu_runtime.compute.losses import soft_target_logprobs
from gpu_runtime.contract.training_settings import MAX_SOFT_TARGETS
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput
from tests.gpu_runtime.test_losses import applied_grads, make_engine, peft_copy
from tests.helpers.engine_tools import assert_relatively_close, result_of, submit

K = 3


def soft_batch(seed: int) -> list[dict[str, Any]]:
    """Two datums of (N, K) targets; the weights renormalised over K per position (the cookbook's), a prompt's
    positions weighing 0, and a teacher that gave fewer than K (a repeated id of weight 0)."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for n in (7, 5):
        ids = torch.randint(10, 500, (n, K), generator=g)
        weights = torch.softmax(torch.randn(n, K, generator=g), -1)
        weights[:2] = 0.0
        ids[2, -1], weights[2, -1] = ids[2, 0], 0.0
        datums.append({"model_input": torch.randint(10, 500, (n,), generator=g).tolist(),
                       "loss_fn_inputs": {"target_tokens": ids.tolist(), "weights": weights.tolist()}})
    return datums


def hard_batch(seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [{"model_input": torch.randint(10, 500, (6,), generator=g).tolist(),
             "loss_fn_inputs": {"target_tokens": torch.randint(10, 500, (6,), generator=g).tolist(),
                                "weights": torch.rand(6, generator=g).tolist()}}]


def reference(engine: Engine, model: str, run_id: str, batch: list[dict[str, Any]], reduction: str,
              ) -> tuple[float, dict[str, torch.Tensor], list[list[float]]]:
    """-Σ w·log_softmax(logits).gather(ids) from PEFT's full fp32 logits on the run's weights: the loss as optim_step
    sees it, its LoRA gradients, and each position's Σ_k w_k·log p(t_k)."""
    peft, params = peft_copy(engine, model, run_id)
    total, normaliser, per_position = torch.zeros(()), 0.0, []
    for datum in batch:
        ids, w = (torch.tensor(datum["loss_fn_inputs"][k]) for k in ("target_tokens", "weights"))
        logits = peft(input_ids=torch.tensor([datum["model_input"]])).logits[0].float()
        scored = (torch.log_softmax(logits, -1).gather(-1, ids) * w).sum(-1)
        total, normaliser = total - scored.sum(), normaliser + float(w.abs().sum())
        per_position.append(scored.detach().tolist())
    scaled = total / normaliser if reduction == "mean" else total
    scaled.backward()
    grads = {name: cast(torch.Tensor, params[name.replace(".weight", ".default.weight")].grad).clone()
             for name in engine.runs[run_id].named_parameters()}
    return float(scaled.detach()), grads, per_position


# PEFT 0.21 reads a property transformers 5 deprecated.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_soft_targets_co_batched_with_a_hard_run_equal_the_full_logits_reference(tmp_path: Path, tiny_model_dir: str,
                                                                                reduction: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"soft": 3, "hard": 4})
    soft, hard = soft_batch(5), hard_batch(6)
    futures = [submit(engine, "forward_backward", run_id="soft", batch=soft, reduction=reduction, return_outputs=True),
               submit(engine, "forward_backward", run_id="hard", batch=hard, reduction="sum")]
    assert engine.tick().base_passes == 1  # one pass: the soft rows beside the hard run's
    got, _ = (result_of(f) for f in futures)
    expected_loss, expected_grads, per_position = reference(engine, tiny_model_dir, "soft", soft, reduction)
    assert got["loss"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-5)
    for output, expected in zip(got["outputs"], per_position):  # logprobs: Σ_k w_k·log p(t_k), the loss its negative
        assert output["logprobs"] == pytest.approx(expected, abs=1e-5)
        assert output["elementwise_loss"] == pytest.approx([-v for v in expected], abs=1e-5)
    grads = applied_grads(engine, "soft")
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_relatively_close(grad, expected_grads[name], name=name)
    # The hard run alone gives what it gave beside the soft rows.
    alone = make_engine(tmp_path / "alone", tiny_model_dir, {"hard": 4})
    assert alone.forward_backward("hard", hard, reduction="sum")["loss"] == pytest.approx(
        result_of(futures[1])["loss"], rel=1e-6)


def test_the_model_logits_path_equals_the_fused_heads(tiny_model_dir: str) -> None:
    """The fallback (a pass that keeps the model's own logits: a run training its unembedding) scores alike."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 5, 16, generator=g), torch.randn(50, 16, generator=g)
    ids = torch.randint(0, 50, (2, 5, K), generator=g)
    ids[0, 1, 2] = IGNORED
    w = torch.rand(2, 5, K, generator=g)
    head = token_logprobs(hidden, weight, torch.full((2, 5), IGNORED), soft_targets=ids, soft_weights=w, chunk_size=7)
    assert head.soft is not None
    torch.testing.assert_close(soft_target_logprobs(hidden @ weight.T, ids, w), head.soft, rtol=1e-5, atol=1e-5)
    assert float(head.logprobs.abs().sum()) == 0.0  # the ignored 1-D targets score nothing


def test_a_soft_datum_survives_the_journals_record() -> None:
    datum = Datum.from_dict({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [[3, 4], [5, 6]],
                                                                        "weights": [[0.0, 0.0], [0.5, 0.5]]}})
    assert datum.targets == [IGNORED, IGNORED] and datum.weights == [0.0, 1.0]
    assert Datum.from_dict(dict(datum.to_dict())) == datum


BAD_SOFT = [
    ({"target_tokens": [[1, 2]] * 3, "weights": [[0.5, 0.5]] * 3, "advantages": [1.0] * 3}, "cross_entropy",
     "advantages"),
    ({"target_tokens": [[1, 2]] * 3, "weights": [[0.5, 0.5]] * 3}, "importance_sampling", "target_tokens"),
    ({"target_tokens": [[1, 2]] * 2, "weights": [[0.5, 0.5]] * 2}, "cross_entropy", "target_tokens"),
    ({"target_tokens": [[1, 2], [1], [1, 2]], "weights": [[0.5, 0.5]] * 3}, "cross_entropy", "target_tokens"),
    ({"target_tokens": [[1] * (MAX_SOFT_TARGETS + 1)] * 3, "weights": [[0.1] * (MAX_SOFT_TARGETS + 1)] * 3},
     "cross_entropy", "target_tokens"),
    ({"target_tokens": [[1, 2]] * 3}, "cross_entropy", "weights"),
    ({"target_tokens": [[1, 2]] * 3, "weights": [0.5] * 3}, "cross_entropy", "weights"),
    ({"target_tokens": [[1, 2]] * 3, "weights": [[0.5, float("nan")]] * 3}, "cross_entropy", "weights"),
    ({"target_tokens": [[1, 10 ** 9]] * 3, "weights": [[0.5, 0.5]] * 3}, "cross_entropy", "target_tokens"),
]


@pytest.mark.parametrize(("inputs", "loss_fn", "field"), BAD_SOFT, ids=[f"{loss}-{field}-{i}" for i, (_, loss, field)
                                                                        in enumerate(BAD_SOFT)])
def test_a_bad_soft_datum_is_refused_naming_its_field(tmp_path: Path, tiny_model_dir: str, inputs: dict[str, Any],
                                                      loss_fn: str, field: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 1})
    if loss_fn != "cross_entropy":
        inputs = {**inputs, "advantages": [1.0] * 3, "logprobs": [-1.0] * 3}
    with pytest.raises(BadInput) as caught:
        engine.forward_backward("r", [{"model_input": [5, 6, 7], "loss_fn_inputs": inputs}], loss_fn=loss_fn)
    assert caught.value.field == f"batch[0].loss_fn_inputs.{field}"
