"""Tinker's wire, /api/v1 (docs/TINKER.md): the endpoints the unmodified `tinker==0.38.0` SDK calls, as a thin
adapter over the service layer. Every operation is a future (app/services/tinker_futures.py), retrieved here; the
runtime work is RunService's, the same path GraphQL takes. Request bodies are JSON except forward_backward's
protobuf. The handlers live by job: sessions, models, training, sampling, and the REST surface (rest.py).
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.tables import User
from app.tinker import custom_losses, downloads, models, rest, sampling, sessions, training
from app.tinker.endpoint import PREFIX, UserHandler, body, endpoint, error, services
from app.tinker.fields import string
from app.tinker.messages import TryAgainResponse, WeightsInfoResponse


async def retrieve_future(request: Request, user: User) -> Response:
    data = await body(request)
    request_id = string(data, "request_id", "") or ""
    answer = await services(request).tinker.retrieve(user, request_id)
    if answer is None:
        return JSONResponse(TryAgainResponse(type="try_again", request_id=request_id, queue_state="active"))
    headers = {} if answer.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(answer.retry_after_s)))}
    return Response(answer.body, status_code=answer.status, media_type=answer.media_type, headers=headers)


async def weights_info(request: Request, user: User) -> WeightsInfoResponse:
    return await rest.weights_info(request, user, await body(request))


async def unsupported(request: Request, user: User | None) -> Response:
    return error(404, f"{request.method} {request.url.path} is not supported by Signal's Tinker endpoint "
                 "(docs/TINKER.md lists what is)")


def routes() -> list[Route]:
    post: dict[str, UserHandler] = {
        "client/config": sessions.client_config, "create_session": sessions.create_session,
        "session_heartbeat": sessions.session_heartbeat, "telemetry": sessions.telemetry,
        "create_model": models.create_model, "get_info": models.get_info, "load_weights": models.load_weights,
        "forward_backward": training.forward_backward, "optim_step": training.optim_step,
        "save_weights": training.save_weights, "save_weights_for_sampler": training.save_weights_for_sampler,
        "create_sampling_session": sampling.create_sampling_session, "asample": sampling.asample,
        "retrieve_future": retrieve_future, "create_custom_loss": custom_losses.create_custom_loss,
    }
    return [
        *(Route(f"{PREFIX}/{path}", endpoint(handler), methods=["POST"]) for path, handler in post.items()),
        Route(f"{PREFIX}/sessions/{{session_id}}/finish", endpoint(sessions.finish_session), methods=["POST"]),
        Route(f"{PREFIX}/samplers/{{sampler_id}}", endpoint(sampling.get_sampler), methods=["GET"]),
        Route(f"{PREFIX}/healthz", endpoint(sessions.healthz, auth=False), methods=["GET"]),
        # The REST surface (RestClient, the tinker CLI). Checkpoint ids hold a '/': the :path route comes after the
        # fixed ones, and the model id segment cannot hold a '/'.
        Route(f"{PREFIX}/weights_info", endpoint(weights_info), methods=["POST"]),
        Route(f"{PREFIX}/get_server_capabilities", endpoint(rest.server_capabilities), methods=["GET"]),
        Route(f"{PREFIX}/checkpoints", endpoint(rest.list_user_checkpoints), methods=["GET"]),
        Route(f"{PREFIX}/billing/usage/checkpoints/current", endpoint(rest.storage_usage), methods=["GET"]),
        Route(f"{PREFIX}/training_runs", endpoint(rest.list_training_runs), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}", endpoint(rest.get_training_run), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints", endpoint(rest.list_checkpoints), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/external_weights_urls",
              endpoint(downloads.external_weights_urls), methods=["GET"]),
        # Before the bare checkpoint route, whose :path would take `weights/x/publish` as a checkpoint id.
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/publish",
              endpoint(rest.publish), methods=["POST"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/publish",
              endpoint(rest.unpublish), methods=["DELETE"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}/ttl",
              endpoint(rest.set_ttl), methods=["PUT"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}",
              endpoint(rest.delete_checkpoint), methods=["DELETE"]),
        Route(f"{PREFIX}/checkpoint_files/{{token}}", endpoint(downloads.checkpoint_file, auth=False), methods=["GET"]),
        # Last: anything else under /api/v1 is 404 JSON naming it (a 404 on client/dynamic_config means defaults).
        Route(PREFIX + "/{rest:path}", endpoint(unsupported, auth=False),
              methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
