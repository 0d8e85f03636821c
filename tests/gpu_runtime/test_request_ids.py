"""A request id names one call (issue 19 §5): the same id with the same body is answered from the first attempt,
the same id with another body is BAD_INPUT naming request_id and changes nothing, while resident, after the run is
restored from its snapshot, and in a restarted runtime rebuilding it from the journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput
from tests.helpers.engine_tools import BATCH

LORA = {"r": 4, "alpha": 8}


def make_run(engine: Engine, base: str) -> None:
    engine.create_run("r", "u", base, LORA, seed=1)


def refused(engine: Engine, method: str, **params: Any) -> BadInput:
    with pytest.raises(BadInput) as raised:
        engine.call(method, run_id="r", **params)
    assert raised.value.field == "request_id"
    return raised.value


def state_of(engine: Engine) -> tuple[int, int, int]:
    info = engine.run_info("r")
    return info["step"], info["pending_forward_backward"], info["pending_tokens"]


# Each primitive with an id: its first call, the same id with another body, and what must have stayed the same.
FIRST: dict[str, dict[str, Any]] = {
    "forward_backward": {"batch": BATCH[:2], "request_id": "fb"},
    "optim_step": {"adam": {"learning_rate": 1e-2}, "request_id": "opt"},
    "save_weights_for_sampler": {"name": "snap", "request_id": "sws"},
    "save_state": {"mode": "state", "name": "ck", "request_id": "save"},
    "sample": {"prompts": ["Hello"], "max_tokens": 2, "temperature": 0.0, "request_id": "smp"},
}
OTHER: dict[str, dict[str, Any]] = {
    "forward_backward": {"batch": BATCH[2:]},
    "optim_step": {"adam": {"learning_rate": 5e-3}},
    "save_weights_for_sampler": {"name": "other"},
    "save_state": {"mode": "adapter"},
    "sample": {"prompts": ["Goodbye"]},
}


@pytest.mark.parametrize("method", list(FIRST))
def test_the_same_id_with_another_body_is_refused_and_with_the_same_body_replayed(
    engine: Engine, tiny_model_dir: str, method: str
) -> None:
    make_run(engine, tiny_model_dir)
    engine.forward_backward("r", BATCH[:1])  # gradients for optim_step to apply
    first = engine.call(method, run_id="r", **FIRST[method])
    before = state_of(engine)

    error = refused(engine, method, **{**FIRST[method], **OTHER[method]})
    assert repr(FIRST[method]["request_id"]) in error.message
    assert state_of(engine) == before  # nothing of the refused call was applied

    again = engine.call(method, run_id="r", **FIRST[method])
    assert again.pop("replayed") is True and again == first
    assert state_of(engine) == before


def test_an_id_cannot_move_to_another_method(engine: Engine, tiny_model_dir: str) -> None:
    """An optim_step sent with a forward_backward's id is another call, not that one's retry."""
    make_run(engine, tiny_model_dir)
    engine.forward_backward("r", BATCH[:2], request_id="x")
    refused(engine, "optim_step", request_id="x")
    refused(engine, "sample", prompts=["Hello"], max_tokens=2, request_id="x")
    assert state_of(engine)[:2] == (0, 1)


def test_a_base_model_sample_remembers_its_body_too(engine: Engine, tiny_model_dir: str) -> None:
    params = {"base_model": tiny_model_dir, "user_id": "u", "max_tokens": 2, "temperature": 0.0, "request_id": "b"}
    first = engine.call("sample", prompts=["Hello"], **params)
    with pytest.raises(BadInput) as raised:
        engine.call("sample", prompts=["Goodbye"], **params)
    assert raised.value.field == "request_id"
    again = engine.call("sample", prompts=["Hello"], **params)
    assert again.pop("replayed") is True and again == first


def test_bodies_survive_a_snapshot_and_a_restart(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu")
    make_run(engine, tiny_model_dir)
    fb = engine.forward_backward("r", BATCH[:2], request_id="fb-1")
    step = engine.optim_step("r", {"learning_rate": 1e-2}, request_id="opt-1")
    engine.close_run("r")  # the run's snapshot now holds the answers
    reopened = Engine(tmp_path, device="cpu")
    refused(reopened, "forward_backward", batch=BATCH[2:], request_id="fb-1")
    refused(reopened, "optim_step", adam={"learning_rate": 5e-3}, request_id="opt-1")

    # Calls after the snapshot are rebuilt from the journal alone.
    fb2 = reopened.forward_backward("r", BATCH[1:3], request_id="fb-2")
    del reopened
    restarted = Engine(tmp_path, device="cpu")
    for runtime in (restarted, restarted):  # restored from snapshot + journal, then resident
        refused(runtime, "forward_backward", batch=BATCH[:1], request_id="fb-2")
        refused(runtime, "forward_backward", batch=BATCH[:1], request_id="fb-1")
        refused(runtime, "optim_step", adam={"learning_rate": 5e-3}, request_id="opt-1")
        for request_id, batch, answer in (("fb-1", BATCH[:2], fb), ("fb-2", BATCH[1:3], fb2)):
            again = runtime.forward_backward("r", batch, request_id=request_id)
            assert again.pop("replayed") is True and again == answer
        again = runtime.optim_step("r", {"learning_rate": 1e-2}, request_id="opt-1")
        assert again.pop("replayed") is True and again == step
        assert state_of(runtime)[:2] == (1, 1)


def test_a_named_checkpoint_keeps_its_saves_body_across_a_restart(tmp_path: Path, tiny_model_dir: str) -> None:
    """Save answers live in memory and snapshots; a named checkpoint's own checkpoint.json answers its retry after a
    restart that forgot it, and holds its body's hash as well."""
    engine = Engine(tmp_path, device="cpu")
    make_run(engine, tiny_model_dir)
    first = engine.call("save_state", run_id="r", mode="state", name="final", request_id="s")
    del engine
    restarted = Engine(tmp_path, device="cpu")
    refused(restarted, "save_state", mode="state", name="final", with_optimizer=False, request_id="s")
    again = restarted.call("save_state", run_id="r", mode="state", name="final", request_id="s")
    assert again.pop("replayed") is True and again == first


def test_load_state_remembers_its_body(engine: Engine, tiny_model_dir: str) -> None:
    make_run(engine, tiny_model_dir)
    engine.call("save_state", run_id="r", mode="state", name="a")
    engine.call("save_state", run_id="r", mode="state", name="b")
    first = engine.call("load_state", run_id="r", checkpoint="a", request_id="load")
    refused(engine, "load_state", checkpoint="b", request_id="load")
    again = engine.call("load_state", run_id="r", checkpoint="a", request_id="load")
    assert again.pop("replayed") is True and again == first
