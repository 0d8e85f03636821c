"""Checkpoints and sampler snapshots as the calls name them: kinds, names and `signal://` references."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.checks import check_id
from gpu_runtime.errors import BadInput

SAVE_MODES = ("adapter", "merged", "state")
CHECKPOINT_KINDS = (*SAVE_MODES, "sampler")  # a checkpoint's kind (its `mode`); "sampler": save_weights_for_sampler's
LOADABLE_KINDS = ("state", "adapter")  # what load_state and create_run(from_checkpoint=…) read: an adapter, ± AdamW
CHECKPOINT_SCHEME = "signal://"  # signal://<run_id>/<kind>/<name>, like Tinker's tinker:// paths (docs/CHECKPOINTS.md)
# The name of a save_state without one: step-N, as migration 0009 named old rows. Only the canonical spelling (no
# leading zero): "step-00" is a name of its own, or it would share step-0's directory and overwrite it.
DEFAULT_NAME = re.compile(r"^step-(0|[1-9][0-9]*)$")
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def default_checkpoint_name(step: int) -> str:
    return f"step-{step}"


def check_checkpoint_name(name: Any, field: str = "name") -> str:
    if not isinstance(name, str) or not CHECKPOINT_NAME.match(name):
        raise BadInput(f"{field} must be 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit, "
                       f"got {name!r}", field=field)
    return name


@dataclass(frozen=True)
class CheckpointRef:
    """Where a checkpoint is: a run, a kind and a name."""

    run_id: str
    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"{CHECKPOINT_SCHEME}{self.run_id}/{self.kind}/{self.name}"


def checkpoint_ref(value: Any, field: str, run_id: str | None = None, kinds: tuple[str, ...] = LOADABLE_KINDS,
                   ) -> CheckpointRef:
    """`signal://<run_id>/<kind>/<name>`, or (with `run_id`, a call on that run) a bare name: that run's state
    checkpoint. The kind must be one of `kinds`."""
    if not isinstance(value, str) or not value:
        raise BadInput(f"{field} must be a checkpoint path signal://<run_id>/<kind>/<name>", field=field)
    if value.startswith(CHECKPOINT_SCHEME):
        parts = value[len(CHECKPOINT_SCHEME):].split("/")
        if len(parts) != 3:
            raise BadInput(f"{field} must be signal://<run_id>/<kind>/<name>, got {value!r}", field=field)
        ref = CheckpointRef(check_id(parts[0], field), parts[1], check_checkpoint_name(parts[2], field))
    elif run_id is not None:
        ref = CheckpointRef(run_id, "state", check_checkpoint_name(value, field))
    else:
        raise BadInput(f"{field} must be a checkpoint path signal://<run_id>/<kind>/<name>, got {value!r}", field=field)
    if ref.kind not in kinds:
        raise BadInput(f"{field}: a {ref.kind!r} checkpoint cannot be loaded; the kinds are {list(kinds)}",
                       field=field)
    return ref


def check_snapshot_name(value: Any, field: str) -> str:
    """A snapshot's name: a checkpoint name (CHECKPOINT_NAME: a path segment, no slashes, no "@"), and no ".."
    anywhere, since it also becomes half of a routing key ("<run>@<name>")."""
    if not isinstance(value, str) or not CHECKPOINT_NAME.match(value) or ".." in value:
        raise BadInput(f"{field} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                       f"got {value!r}", field=field)
    return value
