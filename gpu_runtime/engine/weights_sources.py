"""Where a sample's or a forward's weights come from: one rule for every call that reads weights.

A call names `run_id` (the run's current weights), `run_id` + `snapshot` (a sampler snapshot,
gpu_runtime/engine/snapshots.py), `run_id` + `checkpoint` (a training checkpoint's adapter, kind state or else adapter,
read-only like a named snapshot under "<run_id>@checkpoint:<name>"), or no run with
`base_model` + `user_id` (the base alone). The source gives the routing key its rows go to in the multi-LoRA
layers: the run's id, "<run_id>@<name>", or a key no layer has an adapter under, so the rows compute the plain base.

Only the current weights are in the run's queue; the frozen sources are not (`Sample.frozen`, `Forward.frozen`):
they are resolved whenever they are picked, and wait only for the call that makes them (`pending_save`). A sample
with `latest` names the current weights off the queue: it reads a copy of them made when it is picked
(`Snapshots.latest`), unless `copy_latest` is off (a multi-GPU pool: then it is in the run's queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.quantization import base_key
from gpu_runtime.engine.residency import Residency
from gpu_runtime.engine.run_state import RunState
from gpu_runtime.engine.snapshots import Snapshot, Snapshots
from gpu_runtime.errors import NotFound

BASE_KEY_PREFIX = "base:"  # a routing key no adapter is registered under: the base alone


class WeightsCall(Protocol):
    """What a call that reads weights names (contract Sample and Forward; frozen dataclasses, so read-only)."""

    @property
    def run_id(self) -> str | None: ...
    @property
    def snapshot(self) -> str | None: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def base_model(self) -> str | None: ...
    @property
    def user_id(self) -> str | None: ...


@dataclass
class WeightsSource:
    key: str  # the rows' routing key in the multi-LoRA layers
    base_key: str  # the residency's key of its base
    entry: BaseEntry
    step: int  # the run's step the weights are from (-1: unknown, a snapshot loaded from disk; 0: the base)
    user_id: str
    state: RunState | None = None  # the run's current weights: the call is in the run's queue
    snapshot: Snapshot | None = None  # a frozen adapter: held (in use) while the call reads it

    @property
    def routing_key(self) -> str | None:
        """The key a pass routes its rows to; None: the base alone (no adapter at all)."""
        return None if self.state is None and self.snapshot is None else self.key

    @property
    def known_step(self) -> int | None:
        """The run's step these weights are from, as an answer reports it: None for a base or an unknown step."""
        return None if self.routing_key is None or self.step < 0 else self.step


class Pending(Exception):
    """The source is made by a call still queued on its run: try again after that call."""


def resolve(call: WeightsCall, residency: Residency, snapshots: Snapshots, state_of: Any,
            pending_save: Any, copy_latest: bool = True) -> WeightsSource:
    """The call's weights. `state_of(run_id)` is the run in memory (Recovery.state); `pending_save(run_id, name)`
    says a save_weights_for_sampler making that snapshot is still queued (then `Pending`)."""
    if call.run_id is None:
        assert call.base_model is not None and call.user_id is not None  # the contract's check_weights_source
        entry = residency.base(call.base_model, None)
        return WeightsSource(key=BASE_KEY_PREFIX + call.base_model, base_key=base_key(call.base_model, None),
                             entry=entry, step=0, user_id=call.user_id)
    if call.snapshot is None and call.checkpoint is None:
        state: RunState = state_of(call.run_id)
        if copy_latest and getattr(call, "latest", False):  # Sample's field; a forward has none
            copy = snapshots.latest(state, residency.bases[state.base_key])
            return WeightsSource(key=copy.key, base_key=copy.base_key, entry=residency.bases[copy.base_key],
                                 step=copy.step, user_id=copy.user_id, snapshot=copy)
        return WeightsSource(key=state.run_id, base_key=state.base_key, entry=residency.bases[state.base_key],
                             step=state.step,
                             user_id=state.user_id, state=state)
    if call.checkpoint is not None:  # a training checkpoint's adapter, read-only, like a named snapshot
        snapshot = snapshots.find(call.run_id, call.checkpoint, checkpoint=True)
        if snapshot is None:
            state_of(call.run_id)  # NOT_FOUND for the run itself, when it is the run that is missing
            raise NotFound(f"run {call.run_id} has no state or adapter checkpoint named {call.checkpoint!r}",
                           field="checkpoint")
    else:
        assert call.snapshot is not None
        snapshot = snapshots.find(call.run_id, call.snapshot)
        if snapshot is None:
            if pending_save(call.run_id, call.snapshot):
                raise Pending(call.snapshot)
            state_of(call.run_id)
            raise snapshots.not_found(call.run_id, call.snapshot)
    entry = residency.bases[snapshot.base_key]
    return WeightsSource(key=snapshot.key, base_key=snapshot.base_key, entry=entry, step=snapshot.step, user_id=snapshot.user_id,
                         snapshot=snapshot)

