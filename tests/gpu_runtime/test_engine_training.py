"""forward_backward and optim_step: the numbers, accumulation, isolation between runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput, FailedPrecondition, RunNotFound
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, train

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}


def test_create_run_reports_its_parameters(engine: Engine, tiny_model_dir: str) -> None:
    info = engine.create_run("r1", "u1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=3)
    assert info["run_id"] == "r1" and info["step"] == 0 and info["base_model"] == tiny_model_dir
    assert info["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # r=4 on q,k,v,o of 2 layers (hidden 64, kv dim 32): A is r×in, B is out×r.
    per_layer = 4 * (64 + 64) + 4 * (64 + 32) * 2 + 4 * (64 + 64)
    assert info["trainable_params"] == 2 * per_layer
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert info["total_params"] == sum(p.numel() for p in base.parameters()) + info["trainable_params"]


def test_loss_at_step_zero_is_the_base_models_weighted_mean_token_loss(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, {"r": 4})
    tokens, weights = [28120, 905, 314, 260, 3575], [0.0, 1.0, 0.0, 2.0, 1.0]
    result = engine.forward_backward("r1", [{"tokens": tokens, "weights": weights}])

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    logprobs = torch.log_softmax(base(torch.tensor([tokens[:-1]])).logits[0], -1)
    token_losses = -logprobs[torch.arange(4), torch.tensor(tokens[1:])]
    expected = (token_losses * torch.tensor(weights[1:])).sum() / sum(weights[1:])  # LoRA B starts at 0
    assert result["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert result["num_tokens"] == 3 and result["num_examples"] == 1 and result["step"] == 0


def test_loss_falls_on_a_fixed_batch(engine: Engine, tiny_run: str) -> None:
    losses = train(engine, tiny_run, steps=5, lr=1e-2)
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in zip(losses, losses[1:]))


def test_a_target_with_weight_zero_contributes_nothing(engine: Engine, tiny_run: str) -> None:
    # The last token is only ever a target; with weight 0 its identity cannot matter.
    item = {"tokens": [28120, 905, 314, 260, 3575], "weights": [0, 1, 1, 1, 0]}
    changed = {"tokens": [28120, 905, 314, 260, 17], "weights": [0, 1, 1, 1, 0]}
    first_weight_differs = {"tokens": [28120, 905, 314, 260, 3575], "weights": [7, 1, 1, 1, 0]}
    losses = [engine.forward_backward(tiny_run, [i])["loss"] for i in (item, changed, first_weight_differs)]
    assert losses[0] == losses[1] == losses[2]


def test_two_half_batches_then_one_step_equal_one_full_batch(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("full", "u1", tiny_model_dir, {"r": 4}, seed=5)
    engine.create_run("halves", "u1", tiny_model_dir, {"r": 4}, seed=5)

    full = engine.forward_backward("full", BATCH)
    first = engine.forward_backward("halves", BATCH[:2])
    second = engine.forward_backward("halves", BATCH[2:])
    step_full = engine.optim_step("full", {"learning_rate": 1e-2})
    step_halves = engine.optim_step("halves", {"learning_rate": 1e-2})

    tokens = first["num_tokens"] + second["num_tokens"]
    assert tokens == full["num_tokens"]
    combined = (first["loss"] * first["num_tokens"] + second["loss"] * second["num_tokens"]) / tokens
    assert combined == pytest.approx(full["loss"], rel=1e-5)
    assert step_halves["grad_norm"] == pytest.approx(step_full["grad_norm"], rel=1e-4)
    assert_same_weights(lora_weights(engine, "full"), lora_weights(engine, "halves"), exact=False)


def test_optim_step_applies_gradients_once(engine: Engine, tiny_run: str) -> None:
    engine.forward_backward(tiny_run, BATCH)
    assert engine.optim_step(tiny_run)["step"] == 1
    with pytest.raises(FailedPrecondition):
        engine.optim_step(tiny_run)


def test_optim_step_without_gradients_is_a_failed_precondition(engine: Engine, tiny_run: str) -> None:
    with pytest.raises(FailedPrecondition):
        engine.optim_step(tiny_run, {"learning_rate": 1e-3})


def test_learning_rate_and_clipping_are_reported(engine: Engine, tiny_run: str) -> None:
    engine.forward_backward(tiny_run, BATCH)
    result = engine.optim_step(tiny_run, {"learning_rate": 3e-3, "grad_clip_norm": 0})
    assert result == {"step": 1, "grad_norm": pytest.approx(result["grad_norm"]), "learning_rate": 3e-3,
                      "compute_seconds": pytest.approx(result["compute_seconds"])}
    assert result["grad_norm"] > 0 and result["compute_seconds"] > 0


def test_optim_step_matches_plain_adamw_on_the_same_gradients(engine: Engine, tiny_run: str) -> None:
    run = engine.runs[tiny_run]
    engine.forward_backward(tiny_run, BATCH)
    params = run.parameters()
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    for ref, p in zip(reference, params):
        ref.grad = cast(torch.Tensor, p.grad).detach().clone() / run.pending.normaliser
    adam = {"learning_rate": 1e-2, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "grad_clip_norm": 0}
    engine.optim_step(tiny_run, adam)
    torch.optim.AdamW(reference, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1).step()
    for ref, p in zip(reference, params):
        torch.testing.assert_close(p.detach(), ref.detach())


@pytest.mark.parametrize(
    ("adam", "field"),
    [
        ({"learning_rate": 0}, "adam.learning_rate"),
        ({"learning_rate": -1}, "adam.learning_rate"),
        ({"learning_rate": "fast"}, "adam.learning_rate"),
        ({"beta1": 1.0}, "adam.beta1"),
        ({"beta2": -0.1}, "adam.beta2"),
        ({"eps": 0}, "adam.eps"),
        ({"weight_decay": -1}, "adam.weight_decay"),
        ({"grad_clip_norm": -1}, "adam.grad_clip_norm"),
        ({"momentum": 0.9}, "adam.momentum"),
        ("adam", "adam"),
    ],
)
def test_bad_adam_settings_name_their_field(engine: Engine, tiny_run: str, adam: object, field: str) -> None:
    engine.forward_backward(tiny_run, BATCH)
    with pytest.raises(BadInput) as caught:
        engine.optim_step(tiny_run, adam)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_unknown_loss_fn_and_config(engine: Engine, tiny_run: str) -> None:
    with pytest.raises(BadInput) as caught:
        engine.forward_backward(tiny_run, BATCH, loss_fn="hinge")
    assert caught.value.field == "loss_fn"
    with pytest.raises(BadInput) as caught:
        engine.forward_backward(tiny_run, BATCH, loss_fn_config={"clip": 1})
    assert caught.value.field == "loss_fn_config"


def test_batch_over_max_batch_size(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", max_batch_size=2)
    engine.create_run("r1", "u1", tiny_model_dir)
    with pytest.raises(BadInput) as caught:
        engine.forward_backward("r1", BATCH)
    assert caught.value.field == "batch"


def test_importance_sampling_loss_gradient_is_the_policy_gradient(engine: Engine, tiny_run: str) -> None:
    tokens = [28120, 905, 314, 260]
    # With sampling logprobs equal to the current ones, the ratio is 1: loss = -mean(advantage).
    lp = engine.sample(tiny_run, ["hello"], max_tokens=3, temperature=0)["sequences"][0][0]
    item = {"tokens": [28120, *lp["tokens"]], "logprobs": [0.0, *lp["logprobs"]], "advantages": [0.0, 1.0, -2.0, 0.5]}
    result = engine.forward_backward(tiny_run, [item], loss_fn="importance_sampling")
    assert result["loss"] == pytest.approx(-(1.0 - 2.0 + 0.5) / 3, rel=1e-4)
    assert result["num_tokens"] == 3
    assert engine.optim_step(tiny_run)["grad_norm"] > 0
    with pytest.raises(BadInput) as caught:
        engine.forward_backward(tiny_run, [{"tokens": tokens, "advantages": [0, 1, 1, 1]}], loss_fn="importance_sampling")
    assert caught.value.field == "batch[0].logprobs"


def test_second_run_on_a_base_reuses_the_loaded_base(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir)
    engine.create_run("r2", "u2", tiny_model_dir)
    assert engine.models.load_count == {tiny_model_dir: 1}
    assert engine.runs["r1"].base_model == engine.runs["r2"].base_model == tiny_model_dir
    assert list(engine.residency.bases) == [tiny_model_dir]
    assert engine.residency.bases[tiny_model_dir].model is engine.models.loaded[tiny_model_dir].model
    assert engine.ping()["loaded_models"] == [tiny_model_dir]


def test_backward_touches_only_the_active_runs_parameters(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir)
    engine.create_run("r2", "u1", tiny_model_dir)
    engine.forward_backward("r1", BATCH)
    r1, r2 = engine.runs["r1"].parameters(), engine.runs["r2"].parameters()
    assert all(p.grad is not None for p in r1)
    assert all(p.grad is None for p in r2)
    assert not set(map(id, r1)) & set(map(id, r2))
    opt_params = {id(p) for g in engine.runs["r2"].optimizer.param_groups for p in g["params"]}
    assert opt_params == set(map(id, r2))


Call = Callable[[Engine, str], object]
SCRIPT_A: list[Call] = [
    lambda e, r: e.forward_backward(r, BATCH[:2]),
    lambda e, r: e.forward_backward(r, BATCH[2:]),
    lambda e, r: e.optim_step(r, {"learning_rate": 1e-2}),
    lambda e, r: e.sample(r, ["hello"], max_tokens=4, seed=0),
    lambda e, r: e.forward_backward(r, BATCH),
    lambda e, r: e.save_state(r, "merged"),
    lambda e, r: e.optim_step(r, {"learning_rate": 1e-2}),
]
SCRIPT_B: list[Call] = [
    lambda e, r: e.forward_backward(r, BATCH[1:]),
    lambda e, r: e.optim_step(r, {"learning_rate": 5e-2}),
    lambda e, r: e.forward_backward(r, BATCH[:1]),
    lambda e, r: e.save_state(r, "adapter"),
    lambda e, r: e.forward_backward(r, BATCH[:3]),
    lambda e, r: e.sample(r, ["hi", "there"], max_tokens=3, seed=1, num_samples=2),
    lambda e, r: e.optim_step(r, {"learning_rate": 5e-2}),
]


def test_interleaved_runs_equal_each_run_trained_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    together = Engine(tmp_path / "together", device="cpu")
    together.create_run("a", "u1", tiny_model_dir, LORA, seed=1)
    together.create_run("b", "u2", tiny_model_dir, LORA, seed=2)
    for call_a, call_b in zip(SCRIPT_A, SCRIPT_B):
        call_a(together, "a")
        call_b(together, "b")

    alone: dict[str, Engine] = {}
    for run_id, user, seed, script in (("a", "u1", 1, SCRIPT_A), ("b", "u2", 2, SCRIPT_B)):
        alone[run_id] = Engine(tmp_path / f"alone-{run_id}", device="cpu")
        alone[run_id].create_run(run_id, user, tiny_model_dir, LORA, seed=seed)
        for call in script:
            call(alone[run_id], run_id)

    for run_id in ("a", "b"):
        assert together.run_info(run_id)["step"] == alone[run_id].run_info(run_id)["step"] == 2
        assert_same_weights(lora_weights(together, run_id), lora_weights(alone[run_id], run_id))


def test_same_seed_gives_the_same_lora_init(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, seed=7)
    engine.create_run("r2", "u1", tiny_model_dir, seed=7)
    engine.create_run("r3", "u1", tiny_model_dir, seed=8)
    w1, w2, w3 = (list(lora_weights(engine, r).values()) for r in ("r1", "r2", "r3"))
    assert all(torch.equal(a, b) for a, b in zip(w1, w2))
    assert not all(torch.equal(a, c) for a, c in zip(w1, w3))


def test_unknown_run_is_run_not_found(engine: Engine) -> None:
    for call in (
        lambda: engine.forward_backward("nope", BATCH),
        lambda: engine.optim_step("nope"),
        lambda: engine.sample("nope", ["x"]),
        lambda: engine.save_state("nope", "adapter"),
        lambda: engine.run_info("nope"),
        lambda: engine.close_run("nope"),
    ):
        with pytest.raises(RunNotFound):
            call()
