"""The slotted optimizer tick (gpu_runtime/compute/slot_adamw.py): one tick over the base's slot buffers for every run
stepping, each run's bits its own (whatever steps beside it, the buffers' rank and its slot), within fp32 rounding of
torch's fused AdamW, journaled as "slots" and replayed with it bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_runtime.compute.lora.slots import in_layout_of
from gpu_runtime.compute.optim_tick import StepOrder, optimizer_tick
from gpu_runtime.compute.optimizer import SLOTS
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.journal import Journal

RANKS = (2, 4, 8)
# run i's AdamW settings: learning rates, betas, weight decay and clipping all differ between runs
SETTINGS = [{"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.5},
            {"learning_rate": 3e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1, "grad_clip_norm": 0.0},
            {"learning_rate": 5e-3, "beta1": 0.95, "beta2": 0.9999, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 1e3}]
ROUNDS = 3


def new_engine(path: Path, model: str, extra_rank: int | None = None) -> Engine:
    """Runs "run-i" of RANKS; `extra_rank`: a run of that rank created first (another slot for each, a larger R)."""
    engine = Engine(path, device="cpu")
    if extra_rank is not None:
        engine.create_run("extra", "u-extra", model, {"r": extra_rank, "alpha": extra_rank}, seed=9)
    for i, r in enumerate(RANKS):
        engine.create_run(f"run-{i}", f"u-{i}", model, {"r": r, "alpha": 2 * r}, seed=i)
    return engine


def params(engine: Engine, run_id: str) -> list[torch.nn.Parameter]:
    return [p for group in engine.runs[run_id].optimizer.param_groups for p in group["params"]]


def give_grads(engine: Engine, run_ids: list[str], round_number: int) -> None:
    """Gradients of their own for each run (seeded by run and round), put where a restore would put them."""
    for run_id in run_ids:
        generator = torch.Generator().manual_seed(1000 * round_number + int(run_id[-1]))
        for p in params(engine, run_id):
            p.grad = in_layout_of(p, torch.randn(p.shape, generator=generator) * 0.3)  # fused AdamW reads raw memory


def order(engine: Engine, run_id: str, slotted: bool = True) -> StepOrder:
    state = engine.runs[run_id]
    slots = engine.residency.bases[state.base_key].routing.slots if slotted else None
    return StepOrder(params(engine, run_id), state.optimizer, 4.0, SETTINGS[int(run_id[-1])], slots=slots, key=run_id)


def moments(engine: Engine, run_id: str) -> list[torch.Tensor]:
    optimizer = engine.runs[run_id].optimizer
    return [optimizer.state[p][name] for p in params(engine, run_id) for name in ("exp_avg", "exp_avg_sq")]


def ticks_together_equal_ticks_alone(together: Engine, alone: Engine, runs: list[str],
                                     make_order: Callable[[Engine, str], StepOrder]) -> None:
    """ROUNDS ticks of `runs` stepping together in one engine and one by one in the other: norms, weights and
    moments bitwise equal."""
    for round_number in range(ROUNDS):
        give_grads(together, runs, round_number)
        give_grads(alone, runs, round_number)
        norms = optimizer_tick([make_order(together, run) for run in runs])
        assert norms == [optimizer_tick([make_order(alone, run)])[0] for run in runs]
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(params(together, run), params(alone, run))), run
        assert all(torch.equal(a, b) for a, b in zip(moments(together, run), moments(alone, run))), run


@pytest.mark.parametrize("stepping", [[0, 1, 2], [0, 2]], ids=["consecutive-slots", "gathered-slots"])
def test_runs_with_their_own_settings_in_one_tick_each_equal_their_own_step_alone(
        tmp_path: Path, tiny_model_dir: str, stepping: list[int]) -> None:
    together = new_engine(tmp_path / "together", tiny_model_dir)
    alone = new_engine(tmp_path / "alone", tiny_model_dir, extra_rank=16)  # other slots, R = 16 instead of 8
    runs = [f"run-{i}" for i in stepping]
    ticks_together_equal_ticks_alone(together, alone, runs, order)
    for run in runs:
        assert all(p.grad is None for p in params(together, run))
    untouched = new_engine(tmp_path / "untouched", tiny_model_dir)
    for run in {"run-0", "run-1", "run-2"} - set(runs):  # a run that did not step is left as it was
        assert all(torch.equal(a, b) for a, b in zip(params(together, run), params(untouched, run)))


def test_the_slotted_tick_agrees_with_torchs_fused_adamw_within_fp32_rounding(tmp_path: Path, tiny_model_dir: str) -> None:
    """The update is torch's fused kernel, but the norm is summed over the slot's buffer rows rather than per tensor
    and then stacked, so its last bits (and a clip coefficient's) may differ: over three steps the norms and the
    weights stay within 1e-6 of torch's (relative), the moments within 1e-5."""
    slotted, fused = new_engine(tmp_path / "slotted", tiny_model_dir), new_engine(tmp_path / "fused", tiny_model_dir)
    runs = ["run-0", "run-1", "run-2"]
    for round_number in range(ROUNDS):
        give_grads(slotted, runs, round_number)
        give_grads(fused, runs, round_number)
        ours = optimizer_tick([order(slotted, run) for run in runs])
        torchs = optimizer_tick([order(fused, run, slotted=False) for run in runs])
        assert ours == pytest.approx(torchs, rel=1e-6)
    for run in runs:
        for a, b in zip(params(slotted, run), params(fused, run)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for m, n in zip(moments(slotted, run), moments(fused, run)):
            torch.testing.assert_close(m, n, rtol=1e-5, atol=1e-9)


def test_a_run_whose_norm_is_not_finite_keeps_its_rows_and_the_others_step(tmp_path: Path, tiny_model_dir: str) -> None:
    engine, reference = new_engine(tmp_path / "a", tiny_model_dir), new_engine(tmp_path / "b", tiny_model_dir)
    for e in (engine, reference):
        give_grads(e, ["run-0", "run-1", "run-2"], 0)
        optimizer_tick([order(e, run) for run in ("run-0", "run-1", "run-2")])
    before = [p.detach().clone() for p in params(engine, "run-1")] + [m.clone() for m in moments(engine, "run-1")]
    give_grads(engine, ["run-0", "run-1", "run-2"], 1)
    grad = params(engine, "run-1")[0].grad
    assert grad is not None
    grad[0, 0] = float("inf")
    give_grads(reference, ["run-0", "run-2"], 1)
    norms = optimizer_tick([order(engine, run) for run in ("run-0", "run-1", "run-2")])
    assert norms[1] == float("inf")
    assert norms[0::2] == optimizer_tick([order(reference, run) for run in ("run-0", "run-2")])
    after = [p.detach() for p in params(engine, "run-1")] + moments(engine, "run-1")
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    for run in ("run-0", "run-2"):
        assert all(torch.equal(a, b) for a, b in zip(params(engine, run), params(reference, run)))


BATCH = [{"tokens": [5, 9, 13, 17, 21, 25, 29], "weights": [1.0] * 7}]


def train(engine: Engine, run_id: str, steps: int) -> list[float]:
    norms = []
    for _ in range(steps):
        engine.call("forward_backward", run_id=run_id, batch=BATCH)
        norms.append(engine.call("optim_step", run_id=run_id, adam=SETTINGS[1])["grad_norm"])
    return norms


def test_steps_journaled_as_slots_replay_bit_for_bit_after_a_crash(tmp_path: Path, tiny_model_dir: str) -> None:
    live = Engine(tmp_path, device="cpu")
    live.create_run("r", "u", tiny_model_dir, {"r": 4, "alpha": 8}, seed=3)
    train(live, "r", 3)
    records = Journal(tmp_path / "runs" / "u" / "r" / "journal").read()
    assert [r["kernel"] for r in records if r.get("type") == "optim_step"] == [SLOTS] * 3
    expected = [p.detach().clone() for p in params(live, "r")] + [m.clone() for m in moments(live, "r")]
    restarted = Engine(tmp_path, device="cpu")  # no shutdown: the journal since the first snapshot is replayed
    restarted.run_info("r")
    actual = [p.detach() for p in params(restarted, "r")] + moments(restarted, "r")
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))
    assert train(restarted, "r", 2) == train(live, "r", 2)  # and it trains on alike


def test_a_run_resumed_from_save_state_with_its_optimizer_continues_bit_for_bit(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu")
    engine.create_run("orig", "u", tiny_model_dir, {"r": 4, "alpha": 8}, seed=3)
    train(engine, "orig", 2)
    engine.call("save_state", run_id="orig", mode="state", name="mid")
    engine.call("create_run", run_id="resumed", user_id="u", base_model=tiny_model_dir,
                from_checkpoint="signal://orig/state/mid", with_optimizer=True)
    assert train(engine, "resumed", 2) == train(engine, "orig", 2)
    assert all(torch.equal(a, b) for a, b in zip(params(engine, "resumed"), params(engine, "orig")))
    assert all(torch.equal(a, b) for a, b in zip(moments(engine, "resumed"), moments(engine, "orig")))


class CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched (on a GPU: what is launched, a foreach op over many tensors being one)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.total += 1
        return func(*args, **(kwargs or {}))


def test_a_tick_of_three_runs_dispatches_no_more_torch_ops_than_a_tick_of_one(tmp_path: Path,
                                                                               tiny_model_dir: str) -> None:
    """Runs trained by forward_backward (their gradients linked into the slot rows) step in a fixed handful of ops:
    the per-run work of a tick is the host's bookkeeping, not launches."""
    engine = new_engine(tmp_path, tiny_model_dir)
    ops = {}
    for stepping in (["run-0"], ["run-0", "run-1", "run-2"]):
        for run in stepping:
            engine.call("forward_backward", run_id=run, batch=BATCH)
        orders = [StepOrder(params(engine, run), engine.runs[run].optimizer, 4.0, SETTINGS[0],
                            slots=engine.residency.bases[engine.runs[run].base_key].routing.slots, key=run)
                  for run in stepping]
        optimizer_tick(orders)  # the first step links each run's moments into its rows: once in a run's life
        for run in stepping:
            engine.call("forward_backward", run_id=run, batch=BATCH)
        with CountOps() as counted:
            norms = optimizer_tick(orders)
        assert all(n > 0 for n in norms)
        ops[len(stepping)] = counted.total
    assert ops[3] == ops[1], ops


@pytest.mark.parametrize("stepping", [[0, 1, 2], [0, 2]], ids=["consecutive-slots", "gathered-slots"])
def test_runs_at_different_steps_with_one_setting_share_a_call_and_each_equal_its_step_alone(
        tmp_path: Path, tiny_model_dir: str, stepping: list[int]) -> None:
    """One fused call steps runs whose bias corrections differ (run-0 is a step ahead): each tensor carries its own
    run's count, so each run's bits are those of its step alone."""
    together = new_engine(tmp_path / "together", tiny_model_dir)
    alone = new_engine(tmp_path / "alone", tiny_model_dir, extra_rank=16)
    runs = [f"run-{i}" for i in stepping]

    def shared(engine: Engine, run: str) -> StepOrder:
        stepped = order(engine, run)
        stepped.settings = SETTINGS[0]
        return stepped

    for engine in (together, alone):  # run-0 a step ahead of the others
        give_grads(engine, ["run-0"], 99)
        optimizer_tick([shared(engine, "run-0")])
    ticks_together_equal_ticks_alone(together, alone, runs, shared)
    assert [together.runs[run].optimizer.state[params(together, run)[0]]["step"].item() for run in runs] == \
        [ROUNDS + 1] + [ROUNDS] * (len(runs) - 1)
