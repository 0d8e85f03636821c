"""A checkpoint's files as signed, expiring download links (Tinker's RestClient.get_external_weights_urls): one URL
per file, served by this server itself. A link names its checkpoint row and file, is signed with the server's secret
(itsdangerous; app/security.py) and refused after ARCHIVE_URL_TTL_S; the download needs no key, the signature is the
permission. Only files on this server's disk are linked (the local backend; on Modal, `signal pull` copies them).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from app.errors import NotFound
from app.security import server_secret
from app.services import tinker_paths as paths
from app.tables import Checkpoint, User
from app.tinker.endpoint import PREFIX, services
from app.tinker.messages import ExternalWeightsUrlsResponse

ARCHIVE_URL_TTL_S = 3600  # as Tinker's signed URLs: long enough for a large download to start
SALT = "tinker-checkpoint-file"  # a link signature is good for nothing else the secret signs


def _signer(request: Request) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(server_secret(services(request).settings), salt=SALT)


def _files(row: Checkpoint, data_dir: Path) -> tuple[Path, list[Path]]:
    root = Path(row.path).resolve()
    # The path comes from the runtime: never link anything outside this server's data directory.
    if not root.is_relative_to(data_dir.resolve()) or not root.is_dir():
        raise NotFound("this checkpoint's files are not on this server's disk (signal pull copies them)",
                       field="checkpoint_id")
    return root, sorted(p for p in root.rglob("*") if p.is_file())


async def external_weights_urls(request: Request, user: User) -> ExternalWeightsUrlsResponse:
    svc = services(request)
    model = await svc.tinker_sessions.model(user, request.path_params["model_id"])
    kind, _, name = str(request.path_params["checkpoint_id"]).partition("/")
    run = await svc.runs.get(user, model.run_id or "")
    row = next((c for c in await svc.runs.checkpoints(run) if kind in paths.MODES and c.mode == paths.MODES[kind]
                and c.name == name), None)
    if row is None:
        raise NotFound(f"checkpoint {kind}/{name} of {model.id} not found", field="checkpoint_id")
    root, files = _files(row, svc.settings.data_dir)
    signer, base = _signer(request), str(request.base_url).rstrip("/")
    urls = {str(f.relative_to(root)): f"{base}{PREFIX}/checkpoint_files/"
            f"{signer.dumps([row.id, str(f.relative_to(root))])}" for f in files}
    expires = datetime.now(UTC) + timedelta(seconds=ARCHIVE_URL_TTL_S)
    return {"urls": urls, "expires": expires.isoformat()}


async def checkpoint_file(request: Request, user: User | None) -> Response:
    """The file a signed link names, while the link is fresh and its checkpoint exists; else 404 alike."""
    gone = NotFound("this download link is unknown, expired, or its checkpoint was deleted", field="token")
    try:
        checkpoint_id, relative = _signer(request).loads(request.path_params["token"], max_age=ARCHIVE_URL_TTL_S)
    except (SignatureExpired, BadSignature):
        raise gone from None
    svc = services(request)
    async with svc.db.session() as session:
        row = await session.get(Checkpoint, int(checkpoint_id))
    if row is None or (row.expires_at is not None and row.expires_at.replace(tzinfo=UTC) <= datetime.now(UTC)):
        raise gone
    root, _ = _files(row, svc.settings.data_dir)
    target = (root / str(relative)).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise gone
    return FileResponse(target, filename=target.name)
