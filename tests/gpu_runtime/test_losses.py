"""The five losses (research note §9, docs/LOSSES.md): their derivatives, the runtime's LoRA gradients against a
plain-PEFT fp32 reference under both reductions, co-batching runs with different losses, forward, and bad input."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from gpu_runtime.compute.batches import Datum, collate
from gpu_runtime.compute.losses import LOSSES
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput, FailedPrecondition
from tests.helpers.engine_tools import assert_relatively_close, result_of, submit

LOSS_NAMES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "stable_reinforce"]
CONFIGS: dict[str, dict[str, float]] = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                                        "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                                        "dro": {"beta": 0.3},
                                        "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                                        "stable_reinforce": {"clip_high_threshold": 1.2}}
# log-ratios whose ratios sit well inside or well outside [0.8, 1.2]: 0.61, 0.95, 1.05, 1.65
OFFSETS = [0.5, 0.05, -0.05, -0.5]
TARGETS = ["q_proj", "v_proj"]


def analytic_gradient(loss_fn: str, logp: torch.Tensor, w: torch.Tensor, adv: torch.Tensor, slp: torch.Tensor,
                      config: dict[str, float]) -> torch.Tensor:
    """d loss / d logp of each loss, written out by hand from §9's formulas."""
    ratio = torch.exp(logp - slp)
    if loss_fn == "cross_entropy":
        return -w
    if loss_fn == "importance_sampling":
        return -ratio * adv * w
    if loss_fn == "ppo":  # -min(r A, clip(r) A): the unclipped term's gradient where it is the smaller, else 0
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        clipped = ratio.clamp(low, high)
        unclipped_wins = ratio * adv <= clipped * adv
        return torch.where(unclipped_wins, -ratio * adv, torch.zeros_like(ratio)) * w
    if loss_fn == "cispo":
        return -ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]) * adv * w
    if loss_fn == "stable_reinforce":  # the truncated weight is a constant: REINFORCE's gradient, scaled
        return -ratio.clamp(max=config["clip_high_threshold"]) * adv * w
    return -(adv - config["beta"] * (logp - slp)) * w  # dro


@pytest.mark.parametrize("loss_fn", LOSS_NAMES)
def test_each_losss_gradient_in_fp32_matches_float64_and_the_formula(loss_fn: str) -> None:
    generator = torch.Generator().manual_seed(7)
    rows, width = 3, 8
    logp = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 4 - 0.1
    offsets = torch.tensor(OFFSETS, dtype=torch.float64).repeat(rows, width // len(OFFSETS))
    slp = logp + offsets
    adv = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    weights = torch.randn(rows, width, generator=generator, dtype=torch.float64)  # fractional and negative
    datums = [Datum([1] * width, [2] * width, weights[i].float().tolist(),
                    {"advantages": adv[i].float().tolist(), "logprobs": slp[i].float().tolist()}) for i in range(rows)]
    batch = collate(datums, torch.device("cpu"))
    config = CONFIGS.get(loss_fn, {})
    grads = {}
    for dtype in (torch.float32, torch.float64):
        x = logp.to(dtype).clone().requires_grad_(True)
        LOSSES[loss_fn](x, batch, config).sum().backward()
        assert x.grad is not None
        grads[dtype] = x.grad.double()
    assert (grads[torch.float32] - grads[torch.float64]).abs().max().item() < 1e-6
    # The same inputs as the collated batch (fp32-rounded) in float64, differentiated by hand.
    expected = analytic_gradient(loss_fn, logp, batch.weights.double(), batch.extras["advantages"].double(),
                                 batch.extras["logprobs"].double(), config)
    torch.testing.assert_close(grads[torch.float64], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("low", "high"), [(0.8, 1.2), (1 - 3e-4, 1 + 4e-4)], ids=["wide", "gspo-default"])
def test_gspo_per_token_equals_the_sequence_level_ratio_on_its_mask(low: float, high: float) -> None:
    """With one advantage per sequence, the loss summed over a row and its gradient are GSPO's sequence form:
    -min(s A, clip(s) A), s = exp(mean over sequence_ratio_mask of (lp - slp)); unmasked positions add nothing."""
    generator = torch.Generator().manual_seed(3)
    rows, width = 4, 6
    logp = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3 - 0.1
    slp = logp + torch.randn(rows, width, generator=generator, dtype=torch.float64) * 1e-3
    adv = [1.5, -0.7, 2.0, -1.0]
    mask = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1] * 6, [0, 0, 0, 1, 1, 1]]
    datums = [Datum([1] * width, [2] * width, None, {"advantages": [adv[i]] * width, "logprobs": slp[i].tolist(),
                                                     "sequence_ratio_mask": [float(m) for m in mask[i]]})
              for i in range(rows)]
    batch = collate(datums, torch.device("cpu"))
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    x = logp.clone().requires_grad_(True)
    loss = LOSSES["gspo"](x, batch, config)
    loss.sum().backward()
    y = logp.clone().requires_grad_(True)
    m = torch.tensor(mask, dtype=torch.float64)
    s = torch.exp(((y - batch.extras["logprobs"].double()) * m).sum(-1) / m.sum(-1))
    a = torch.tensor(adv, dtype=torch.float64)
    expected = -torch.minimum(s * a, s.clamp(low, high) * a)
    expected.sum().backward()
    torch.testing.assert_close(loss.sum(-1).detach(), expected.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-9)
    assert bool((cast(torch.Tensor, x.grad)[m == 0] == 0).all())


def test_stable_reinforce_truncates_the_importance_weight_at_the_cap() -> None:
    # ratios 0.61, 1.65, 3.0: the weight is the ratio, capped at 2.0 (the default), never clipped from below
    slp = [-1.0 + 0.5, -1.0 - 0.5, -1.0 - math.log(3.0)]
    batch = collate([Datum([1] * 3, [2] * 3, None, {"advantages": [1.0] * 3, "logprobs": slp})], torch.device("cpu"))
    x = torch.full((1, 3), -1.0, dtype=torch.float64, requires_grad=True)
    LOSSES["stable_reinforce"](x, batch, {"clip_high_threshold": 2.0}).sum().backward()
    assert cast(torch.Tensor, x.grad)[0].tolist() == pytest.approx([-math.exp(-0.5), -math.exp(0.5), -2.0], rel=1e-6)


def test_per_token_clip_thresholds_win_over_the_config() -> None:
    inputs = {"advantages": [1.0, 1.0], "logprobs": [-1.5, -1.5]}
    own = Datum([1, 1], [2, 2], None, {**inputs, "clip_high_threshold": [2.0, 1.5]})
    batch = collate([own, Datum([1, 1], [2, 2], None, inputs)], torch.device("cpu"))  # the second gave none
    loss = LOSSES["ppo"](torch.full((2, 2), -1.0), batch, CONFIGS["ppo"])
    ratio = math.exp(0.5)  # 1.65: under the first datum's 2.0, clipped to its 1.5, and to the config's 1.2
    assert loss[0].tolist() == pytest.approx([-ratio, -1.5])
    assert loss[1].tolist() == pytest.approx([-1.2, -1.2])


# ---- the runtime against a plain PEFT reference ------------------------------------------------------


def make_engine(path: Path, model: str, runs: dict[str, int], dropout: float = 0.0) -> Engine:
    engine = Engine(path, device="cpu")
    for run_id, seed in runs.items():
        engine.create_run(run_id, "user-1", model, {"r": 4, "alpha": 8, "dropout": dropout, "target_modules": TARGETS},
                          seed=seed)
        with torch.no_grad():  # a trained B (PEFT starts it at zero), so A's gradients are not all zero
            for _, B in engine.runs[run_id].weights.values():
                B.normal_(std=0.2, generator=torch.Generator().manual_seed(seed))
    return engine


def rl_batch(engine: Engine, run_id: str, seed: int) -> list[dict[str, Any]]:
    """Two RL datums (rl_loop's shape: prompt positions target 0 with advantage 0), whose sampler logprobs sit
    at fixed log-ratios from the run's own (read with forward)."""
    generator = torch.Generator().manual_seed(seed)
    datums: list[dict[str, Any]] = []
    for n in (7, 5):
        ids = torch.randint(10, 500, (n,), generator=generator).tolist()
        targets = [0, 0] + torch.randint(10, 500, (n - 2,), generator=generator).tolist()
        advantages = [0.0, 0.0] + (torch.randn(n - 2, generator=generator) + 0.5).tolist()
        datums.append({"model_input": ids, "loss_fn_inputs": {"target_tokens": targets, "advantages": advantages,
                                                              "weights": (torch.rand(n, generator=generator) * 2 - 0.5).tolist()}})
    current = engine.forward([{"model_input": d["model_input"], "loss_fn_inputs": {
        "target_tokens": d["loss_fn_inputs"]["target_tokens"]}} for d in datums], run_id=run_id)["outputs"]
    for datum, out in zip(datums, current):
        datum["loss_fn_inputs"]["logprobs"] = [lp + OFFSETS[i % 4] for i, lp in enumerate(out["logprobs"])]
    return datums


def reference_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, Any], config: dict[str, float],
                   ) -> tuple[torch.Tensor, float]:
    """§9's formula for one datum, written independently of gpu_runtime.compute.losses: (sum, the mean's normaliser)."""
    w = torch.tensor(inputs["weights"])
    if loss_fn == "cross_entropy":
        return -(logp * w).sum(), float(w.abs().sum())
    adv, slp = torch.tensor(inputs["advantages"]), torch.tensor(inputs["logprobs"])
    ratio = torch.exp(logp - slp)
    if loss_fn == "importance_sampling":
        per = ratio * adv
    elif loss_fn == "ppo":
        per = torch.minimum(ratio * adv, ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]) * adv)
    elif loss_fn == "cispo":
        per = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach() * logp * adv
    elif loss_fn == "stable_reinforce":
        per = ratio.clamp(max=config["clip_high_threshold"]).detach() * logp * adv
    elif loss_fn == "gspo":  # GSPO-token: the sequence's ratio s at each masked position, its gradient s * dlogp
        mask = (w != 0).to(logp.dtype)
        length = mask.sum().clamp(min=1.0)
        s = torch.exp(((logp - slp) * mask).sum() / length).detach() * torch.exp(logp - logp.detach())
        clipped = s.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        return -(torch.minimum(s * adv, clipped * adv) * mask / length * w).sum(), float(mask.sum())
    else:
        per = logp * adv - 0.5 * config["beta"] * (logp - slp) ** 2
    return -(per * w).sum(), float((w != 0).sum())


def peft_copy(engine: Engine, model: str, run_id: str) -> tuple[Any, dict[str, torch.nn.Parameter]]:
    """PEFT on `model` in fp32 with the run's LoRA weights copied in: the model and its named parameters."""
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    params = dict(peft.named_parameters())
    with torch.no_grad():
        for name, param in engine.runs[run_id].named_parameters().items():
            params[name.replace(".weight", ".default.weight")].copy_(param)
    return peft, params


def peft_reference(engine: Engine, model: str, run_id: str, loss_fn: str, batch: list[dict[str, Any]],
                   reduction: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and LoRA gradients as optim_step will apply them, from PEFT on the run's weights in fp32."""
    peft, params = peft_copy(engine, model, run_id)
    total, normaliser = torch.zeros(()), 0.0
    for datum in batch:
        inputs = datum["loss_fn_inputs"]
        logits = peft(input_ids=torch.tensor([datum["model_input"]])).logits[0].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(inputs["target_tokens"])[:, None])[:, 0]
        loss_sum, norm = reference_loss(loss_fn, logp, inputs, CONFIGS.get(loss_fn, {}))
        total, normaliser = total + loss_sum, normaliser + norm
    scaled = total / normaliser if reduction == "mean" else total
    scaled.backward()
    grads = {name: cast(torch.Tensor, params[name.replace(".weight", ".default.weight")].grad).clone()
             for name in engine.runs[run_id].named_parameters()}
    return float(scaled.detach()), grads


def applied_grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    """The run's summed gradients divided as optim_step divides them."""
    state = engine.runs[run_id]
    return {name: p.grad / state.pending.divisor for name, p in state.named_parameters().items() if p.grad is not None}


# PEFT 0.21 reads a property transformers 5 deprecated.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_fn", [*LOSS_NAMES, "gspo"])
def test_the_runtimes_lora_gradients_equal_pefts_for_the_same_loss(tmp_path: Path, tiny_model_dir: str, loss_fn: str,
                                                                  reduction: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 3})
    batch = rl_batch(engine, "r", seed=11)
    result = engine.forward_backward("r", batch, loss_fn=loss_fn, loss_fn_config=CONFIGS.get(loss_fn),
                                     reduction=reduction)
    expected_loss, expected = peft_reference(engine, tiny_model_dir, "r", loss_fn, batch, reduction)
    assert result["reduction"] == reduction
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    got = applied_grads(engine, "r")
    assert got.keys() == expected.keys() and len(got) == 2 * 2 * len(TARGETS)  # A and B, two layers
    for name in got:
        assert_relatively_close(got[name], expected[name], name=name)


def test_runs_with_different_losses_and_reductions_share_one_pass_as_if_alone(tmp_path: Path,
                                                                            tiny_model_dir: str) -> None:
    plan = {"ce": ("cross_entropy", "sum"), "is": ("importance_sampling", "mean"), "ppo": ("ppo", "sum"),
            "cispo": ("cispo", "mean"), "dro": ("dro", "sum"), "gspo": ("gspo", "sum"),
            "sr": ("stable_reinforce", "mean")}
    seeds = {run_id: i + 1 for i, run_id in enumerate(plan)}
    together = make_engine(tmp_path / "together", tiny_model_dir, seeds)
    batches = {run_id: rl_batch(together, run_id, seed=seeds[run_id]) for run_id in plan}
    futures = {run_id: submit(together, "forward_backward", run_id=run_id, batch=batches[run_id], loss_fn=loss_fn,
                              loss_fn_config=CONFIGS.get(loss_fn), reduction=reduction, return_outputs=True)
               for run_id, (loss_fn, reduction) in plan.items()}
    assert together.tick().base_passes == 1
    for run_id, (loss_fn, reduction) in plan.items():
        alone = make_engine(tmp_path / f"alone-{run_id}", tiny_model_dir, {run_id: seeds[run_id]})
        expected = alone.forward_backward(run_id, batches[run_id], loss_fn=loss_fn,
                                          loss_fn_config=CONFIGS.get(loss_fn), reduction=reduction,
                                          return_outputs=True)
        got = result_of(futures[run_id])
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        for mine, theirs in zip(got["outputs"], expected["outputs"]):
            assert mine["logprobs"] == pytest.approx(theirs["logprobs"], rel=1e-5, abs=1e-6)
        grads_alone = applied_grads(alone, run_id)
        for name, grad in applied_grads(together, run_id).items():
            assert_relatively_close(grad, grads_alone[name], name=f"{run_id} {name}")


# ---- per-position outputs ---------------------------------------------------------------------------


def test_outputs_come_only_when_asked_and_never_with_a_retry(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 1})
    batch = rl_batch(engine, "r", seed=3)
    plain = engine.forward_backward("r", batch, loss_fn="ppo", request_id="fb-1")
    assert "outputs" not in plain
    asked = engine.forward_backward("r", batch, loss_fn="ppo", request_id="fb-2", return_outputs=True)
    assert [len(o["logprobs"]) for o in asked["outputs"]] == [len(d["model_input"]) for d in batch]
    assert [len(o["elementwise_loss"]) for o in asked["outputs"]] == [len(d["model_input"]) for d in batch]
    # The elementwise losses sum to the call's loss (a mean: over the positions with weight).
    counted = sum(sum(1 for w in d["loss_fn_inputs"]["weights"] if w != 0) for d in batch)
    assert sum(sum(o["elementwise_loss"]) for o in asked["outputs"]) / counted == pytest.approx(asked["loss"], rel=1e-5)
    again = engine.forward_backward("r", batch, loss_fn="ppo", request_id="fb-2", return_outputs=True)
    assert again["replayed"] is True and "outputs" not in again and again["loss"] == asked["loss"]
    assert engine.runs["r"].pending.calls == 2


# ---- forward ----------------------------------------------------------------------------------------


def test_forward_equals_forward_backwards_logprobs_and_changes_nothing(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 1})
    batch = rl_batch(engine, "r", seed=5)
    forward = engine.forward(batch, run_id="r", loss_fn="importance_sampling")
    state = engine.runs["r"]
    assert all(p.grad is None for p in state.parameters()) and state.pending.calls == 0 and state.step == 0
    fb = engine.forward_backward("r", batch, loss_fn="importance_sampling", return_outputs=True)
    assert forward["loss"] == pytest.approx(fb["loss"], rel=1e-6)
    for mine, theirs in zip(forward["outputs"], fb["outputs"]):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], rel=1e-6, abs=1e-7)
    before = {name: cast(torch.Tensor, p.grad).clone() for name, p in state.named_parameters().items()}
    engine.forward(batch, run_id="r")
    assert state.pending.calls == 1 and state.step == 0
    for name, p in state.named_parameters().items():
        assert torch.equal(cast(torch.Tensor, p.grad), before[name])


def test_forward_draws_no_dropout_and_moves_no_dropout_counter(tmp_path: Path, tiny_model_dir: str) -> None:
    text = [{"text": "The quick brown fox jumps over the lazy dog."}]
    runs = {}
    for name, with_forward in (("plain", False), ("forwarded", True)):
        engine = make_engine(tmp_path / name, tiny_model_dir, {"r": 1}, dropout=0.3)
        first = engine.forward(text, run_id="r")
        assert engine.forward(text, run_id="r")["outputs"] == first["outputs"]  # no mask drawn: the same twice
        engine.forward_backward("r", text)
        if with_forward:
            engine.forward(text, run_id="r")  # between two calls: the second's dropout seed must not move
        engine.forward_backward("r", text)
        runs[name] = {n: cast(torch.Tensor, p.grad).clone() for n, p in engine.runs["r"].named_parameters().items()}
    for name, grad in runs["plain"].items():
        assert torch.equal(grad, runs["forwarded"][name]), name


def test_forward_on_a_base_model_alone_is_a_run_with_no_adapter(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu")
    engine.create_run("fresh", "user-1", tiny_model_dir, {"r": 4, "alpha": 8})  # B starts at 0: the base's logits
    batch = [{"text": "The quick brown fox"}, {"input": "Q: 2 + 2?", "output": " 4"}]
    base = engine.forward(batch, base_model=tiny_model_dir, user_id="user-1")
    run = engine.forward(batch, run_id="fresh")
    assert base["step"] is None and run["step"] == 0
    assert base["outputs"] == run["outputs"] and base["loss"] == run["loss"]
    assert base["loss"] > 0


# ---- one reduction per step, restored by replay ---------------------------------------------------


@pytest.mark.parametrize("restored_from", ["journal", "snapshot"])
def test_another_reduction_before_optim_step_is_refused_naming_reduction(tmp_path: Path, tiny_model_dir: str,
                                                                         restored_from: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 1})
    text = [{"text": "hello there"}]
    engine.forward_backward("r", text, reduction="sum")
    with pytest.raises(FailedPrecondition) as caught:
        engine.forward_backward("r", text, reduction="mean")
    assert caught.value.field == "reduction" and caught.value.code == "FAILED_PRECONDITION"
    if restored_from == "snapshot":
        engine.shutdown()  # snapshots the run, its pending gradients with it
        assert engine.runs["r"].snapshot_seq == engine.runs["r"].seq
    # A restarted runtime restores the run (snapshot + journal after it): the step's reduction comes back with it.
    restarted = Engine(tmp_path, device="cpu")
    restarted.run_info("r")
    assert restarted.runs["r"].pending.reduction == "sum"
    with pytest.raises(FailedPrecondition):
        restarted.forward_backward("r", text, reduction="mean")
    restarted.forward_backward("r", text, reduction="sum")
    restarted.optim_step("r")
    assert restarted.forward_backward("r", text, reduction="mean")["reduction"] == "mean"  # a new step, a new choice


def test_a_step_of_datums_that_weigh_nothing_applies(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = make_engine(tmp_path, tiny_model_dir, {"r": 1})
    group = [{"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 7, 8], "advantages": [0.0] * 3,
                                                           "logprobs": [-1.0] * 3}}] * 2  # a GRPO group, equal rewards
    result = engine.forward_backward("r", group, loss_fn="importance_sampling")
    assert (result["loss"], result["num_tokens"]) == (0.0, 0)
    assert all(float(cast(torch.Tensor, p.grad).abs().max()) == 0.0 for p in engine.runs["r"].parameters())
    assert engine.optim_step("r")["step"] == 1


BAD_CALLS: list[tuple[dict[str, Any], str]] = [
    ({"batch": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1.0]}}]},
     "batch[0].loss_fn_inputs.weights"),
    ({"batch": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "logprobs": [0.0, 0.0]}}],
      "loss_fn": "importance_sampling"}, "batch[0].loss_fn_inputs.advantages"),
    ({"batch": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 10**7]}}]},
     "batch[0].loss_fn_inputs.target_tokens"),
    ({"batch": [{"text": "hi"}], "reduction": "median"}, "reduction"),
    ({"batch": [{"text": "hi"}], "loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": "x"}},
     "loss_fn_config.clip_low_threshold"),
]


@pytest.mark.parametrize(("params", "field"), BAD_CALLS, ids=[f for _, f in BAD_CALLS])
def test_bad_input_names_the_field(engine: Engine, tiny_run: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(BadInput) as caught:
        engine.call("forward_backward", run_id=tiny_run, **params)
    assert caught.value.field == field
