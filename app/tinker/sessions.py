"""The SDK's client-level calls: its configuration, sessions and their heartbeats, telemetry, health."""

from __future__ import annotations

from starlette.requests import Request

from app.tables import User
from app.tinker.endpoint import body, services
from app.tinker.fields import obj, string
from app.tinker.messages import (
    ClientConfigResponse,
    CreateSessionResponse,
    Empty,
    HealthResponse,
    SessionHeartbeatResponse,
    TelemetryResponse,
)

SAMPLE_MAX_CONCURRENT_REQUESTS = 64  # sampling futures one client keeps in flight; each holds a long-poll


async def client_config(request: Request, user: User) -> ClientConfigResponse:
    settings = services(request).settings
    return {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": settings.max_batch_size,
            "fwdbwd_max_chunk_bytes_count": settings.max_request_bytes // 2, "proto_compress_fwdbwd": True,
            "sample_max_concurrent_requests": SAMPLE_MAX_CONCURRENT_REQUESTS,
            "custom_loss_server_side": True}  # create_custom_loss graphs run in the pass (app/tinker/custom_losses.py)


async def create_session(request: Request, user: User) -> CreateSessionResponse:
    data = await body(request)
    session_id = await services(request).tinker_sessions.create(user, string(data, "display_name"),
                                                                obj(data, "user_metadata"))
    return {"session_id": session_id, "type": "create_session"}


async def session_heartbeat(request: Request, user: User) -> SessionHeartbeatResponse:
    data = await body(request)
    await services(request).tinker_sessions.heartbeat(user, string(data, "session_id", "") or "")
    return {"type": "session_heartbeat"}


async def finish_session(request: Request, user: User) -> Empty:
    await services(request).tinker_sessions.finish(user, request.path_params["session_id"])
    return {}


async def telemetry(request: Request, user: User) -> TelemetryResponse:
    return {"status": "accepted"}


async def healthz(request: Request, user: User) -> HealthResponse:
    return {"status": "ok"}
