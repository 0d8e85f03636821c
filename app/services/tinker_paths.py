"""`tinker://{model_id}/{weights|sampler_weights}/{name}` paths and their Signal checkpoints."""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.errors import BadInput

NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# Tinker's kind → Signal's checkpoint mode. A training checkpoint is a resumable state (adapter + AdamW); a sampler
# checkpoint is a named sampler snapshot (docs/SNAPSHOTS.md): the weights frozen at its seq_id.
MODES = {"weights": "state", "sampler_weights": "sampler"}


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str  # weights | sampler_weights
    name: str

    @property
    def path(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def mode(self) -> str:
        return MODES[self.kind]


def check_name(name: object, field: str = "path") -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise BadInput(f"{field}: a checkpoint name matches {NAME.pattern}, got {name!r}", field=field)
    return name


def parse(path: object, field: str = "path") -> TinkerPath:
    """Exactly three segments after the scheme; the model id may hold ':' but no '/'."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise BadInput(f"{field} must be a tinker:// path, got {path!r}", field=field)
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or parts[1] not in MODES or not parts[0]:
        raise BadInput(f"{field} must be tinker://<model_id>/weights|sampler_weights/<name>, got {path!r}",
                       field=field)
    return TinkerPath(parts[0], parts[1], check_name(parts[2], field))
