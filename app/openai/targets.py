"""What a /v1 request's `model` names, resolved for its caller: a run's current weights, a sampler snapshot of it
(`{run_id}@{name}`, or the `tinker://{model_id}/sampler_weights/{name}` path Tinker's save_weights_for_sampler
returns), or a catalogue base model alone; and the models list's entries. Another user's run is not found."""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import SignalError
from app.openai.errors import model_not_found
from app.services import Services, tinker_paths
from app.tables import Run, User
from gpu_runtime.contract.json_types import JSONObject


@dataclass(frozen=True)
class Target:
    """What `model` names: a run's current weights, a sampler snapshot of it, or a catalogue base model (`run` None)."""

    name: str
    run: Run | None = None
    snapshot: str | None = None
    base_model: str | None = None


async def resolve(services: Services, user: User, name: str) -> Target:
    if name.startswith("tinker://"):
        run_id, snapshot = await _tinker_path(services, user, name)
    elif any(model.name == name for model in services.catalog.list()):
        return Target(name, base_model=name)
    else:
        run_id, _, snapshot = name.partition("@")
    try:
        run = await services.runs.get(user, run_id)  # another user's run: not found, like an unknown one
    except SignalError:
        raise model_not_found(name) from None
    if snapshot and snapshot not in {row.name for row in await services.runs.checkpoints(run) if row.mode == "sampler"}:
        raise model_not_found(name, f"run {run_id!r} has no sampler snapshot {snapshot!r}: make one with "
                                    "save_weights_for_sampler")
    return Target(name, run, snapshot or None)


async def _tinker_path(services: Services, user: User, name: str) -> tuple[str, str]:
    """A Tinker model's run and the snapshot's name (what `{run_id}@{name}` names)."""
    try:
        path = tinker_paths.parse(name, "model")
        model = await services.tinker_sessions.model(user, path.model_id)
    except SignalError:
        raise model_not_found(name) from None
    if path.kind != "sampler_weights" or not model.run_id:
        raise model_not_found(name, f"The model {name!r} is a Tinker training checkpoint; /v1 samples sampler "
                                    "weights: tinker://{model_id}/sampler_weights/{name} (save_weights_for_sampler)")
    return model.run_id, path.name


def entry(target: Target, created: int = 0) -> JSONObject:
    """A target as OpenAI's model object."""
    run = target.run
    root = run.base_model if run is not None else target.base_model
    return {"id": target.name, "object": "model", "created": int(run.created_at.timestamp()) if run else created,
            "owned_by": "user" if run is not None else "signal", "root": root}


async def listed(services: Services, user: User) -> list[JSONObject]:
    """The caller's runs and their sampler snapshots (as `{run_id}@{name}`, and as `tinker://` paths for a run a
    Tinker model drives), and the catalogue's models this server can load."""
    tinker_models, _ = await services.tinker_sessions.models(user, limit=1000, offset=0)
    tinker_ids = {row.run_id: row.id for row in tinker_models if row.run_id}
    data = []
    for run in await services.runs.list(user, limit=1000):
        data.append(entry(Target(run.id, run)))
        for row in await services.runs.checkpoints(run):
            if row.mode == "sampler" and row.name:
                data.append(entry(Target(f"{run.id}@{row.name}", run, row.name)))
                if run.id in tinker_ids:
                    path = tinker_paths.TinkerPath(tinker_ids[run.id], "sampler_weights", row.name).path
                    data.append(entry(Target(path, run, row.name)))
    return data + [entry(Target(model.name, base_model=model.name)) for model in services.catalog.list()
                   if model.available]
