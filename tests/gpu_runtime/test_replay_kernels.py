"""A forward_backward's journal record names the LoRA kernel its passes ran (`lora_kernel`), and replay runs that one:
a co-batched call journaled under the grouped kernel replays alone to the same bits (weights, pending gradients,
AdamW moments). Records naming none (written before kernels were named) replay with the per-segment reference:
tests/gpu_runtime/test_journal_v10.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.compute.plan import PassPart
from gpu_runtime.compute.training import _lora_kernel
from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, result_of, submit

# Two runs of rank 4 (one group of two segments), one of rank 8 (a group alone), dropout on one. Rows of one width:
# a pass padded wider than a call's own rows replays to other bits whatever the LoRA kernel (the base's matmuls and
# attention over the padding; known, not the kernels').
RUNS: dict[str, tuple[str, dict[str, Any], int]] = {
    "a": ("u1", {"r": 4, "alpha": 8}, 1),
    "b": ("u2", {"r": 4, "alpha": 16, "dropout": 0.1}, 2),
    "c": ("u3", {"r": 8, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}, 3),
}
BATCHES = {"a": BATCH[:1], "b": BATCH[:1], "c": BATCH[:1] * 2}


def one_tick(engine: Engine, method: str, **params: Any) -> None:
    futures = [submit(engine, method, run_id=run_id, **params,
                      **({"batch": BATCHES[run_id]} if method == "forward_backward" else {})) for run_id in RUNS]
    stats = engine.tick()
    assert method != "forward_backward" or stats.base_passes == 1  # co-batched
    for future in futures:
        assert "error" not in result_of(future)


@pytest.mark.parametrize("kernel", ["grouped", "torch"])
def test_a_cobatched_journal_replays_bitwise_under_its_kernel(tmp_path: Path, tiny_model_dir: str, kernel: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", kernel)  # live passes only: a replay runs what its record names
    live = Engine(tmp_path, device="cpu", snapshot_every_steps=1000)
    for run_id, (user, lora, seed) in RUNS.items():
        live.create_run(run_id, user, tiny_model_dir, lora, seed=seed)
    one_tick(live, "forward_backward")
    one_tick(live, "optim_step", adam={"learning_rate": 1e-2})
    one_tick(live, "forward_backward")  # pending gradients at the crash
    for state in live.runs.values():
        kernels = [r.get("lora_kernel") for r in state.journal.read() if r["type"] == "forward_backward"]
        assert kernels == [kernel, kernel]
        state.journal.close()

    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "torch" if kernel == "grouped" else "grouped")  # the other one
    restarted = Engine(tmp_path, device="cpu", snapshot_every_steps=1000)  # a crash: no shutdown snapshot
    for run_id in RUNS:
        assert restarted.run_info(run_id)["pending_forward_backward"] == 1
        assert_same_weights(lora_weights(restarted, run_id), lora_weights(live, run_id))
        ours, theirs = restarted.runs[run_id], live.runs[run_id]
        for (name, mine), other in zip(ours.named_parameters().items(), theirs.named_parameters().values()):
            assert mine.grad is not None and other.grad is not None and torch.equal(mine.grad, other.grad), name
        for mine_state, other_state in zip(ours.optimizer.state_dict()["state"].values(),
                                           theirs.optimizer.state_dict()["state"].values()):
            assert all(torch.equal(mine_state[key], other_state[key]) for key in mine_state)


def part(kernel: str | None) -> PassPart:
    return PassPart("r", [], 0, 0, 0, None, "cross_entropy", lora_kernel=kernel)


def test_a_pass_runs_its_replayed_records_kernel_and_refuses_two() -> None:
    cpu = torch.device("cpu")
    assert _lora_kernel([part(None), part(None)], cpu) == "grouped"  # live: today's kernel
    assert _lora_kernel([part("torch")], cpu) == "torch"
    assert _lora_kernel([part("legacy")], cpu) == "torch"  # a record naming none: the per-segment reference
    with pytest.raises(ValueError, match="one LoRA kernel"):
        _lora_kernel([part("torch"), part("grouped")], cpu)
