"""Published checkpoints (RestClient.publish/unpublish_checkpoint_from_tinker_path): the owner publishes one, and any
signed-in user may then read it by its tinker:// path, read-only: sample it (billed to the reader), see it listed and
described. Writing it (save, delete, unpublish, load into a run) stays its owner's: those paths never come here.
Publishing is rest.py's (the owner's alone)."""

from __future__ import annotations

from app.errors import NotFound, RunNotFound
from app.services import Services
from app.services import tinker_paths as paths
from app.tables import Run, TinkerModel, User


def frozen(source: paths.TinkerPath) -> tuple[str | None, str | None]:
    """(snapshot, checkpoint): how a sample or forward names the weights at that path."""
    return (source.name, None) if source.kind == "sampler_weights" else (None, source.name)


async def readable(svc: Services, user: User, source: paths.TinkerPath) -> tuple[TinkerModel, Run]:
    """The model and run a tinker:// path names, to read it: the caller's own, or another user's whose checkpoint
    at that very path is published. Otherwise the caller's own "model not found", word for word: an unpublished
    checkpoint of another user is indistinguishable from none."""
    model = await svc.tinker_sessions.trained(source.model_id)
    if model is not None and model.user_id != user.id and model.run_id:
        try:
            return model, await svc.runs.calls.readable(user, model.run_id, *frozen(source))
        except (NotFound, RunNotFound):
            pass
    model = await svc.tinker_sessions.model(user, source.model_id)  # the caller's own, or its not found
    return model, await svc.runs.get(user, model.run_id or "")
