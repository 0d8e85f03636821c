"""Tinker's server-side custom losses: `create_custom_loss` checks a traced graph (gpu_runtime/contract/custom_loss.py:
an allow-list of tensor operations, bounded in nodes and constants) and keeps it per Tinker session; a forward_backward
with loss_fn "custom" and loss_fn_config {"loss_id"} sends the graph with the call, and the runtime runs it per datum
inside the co-batched pass (docs/LOSSES.md).

The graphs are kept in this server process, as stability records are (app/tinker/stability.py): a deployment of
several processes must send a session's calls to the process that created its losses (docs/TINKER.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from starlette.requests import Request

from app.errors import BadInput, NotFound
from app.services.tinker_futures import json_answer
from app.services.tinker_sessions import session_of
from app.tables import User
from app.tinker.endpoint import body, future_answer, services
from app.tinker.fields import integer, string
from app.tinker.messages import UntypedAPIFuture
from gpu_runtime.contract.custom_loss import CustomLoss, parse_custom_loss
from gpu_runtime.contract.json_types import JSONObject

MAX_LOSSES_PER_USER = 256  # a loss is a few KB; the oldest goes first past this


class CustomLossStore:
    """(user, loss_id) → the checked graph; a loss_id names its session, and only that session's models use it."""

    def __init__(self, max_per_user: int = MAX_LOSSES_PER_USER) -> None:
        self.max_per_user = max_per_user
        self._users: dict[str, OrderedDict[str, CustomLoss]] = {}
        self._lock = threading.Lock()

    def put(self, user_id: str, loss_id: str, loss: CustomLoss) -> None:
        with self._lock:
            losses = self._users.setdefault(user_id, OrderedDict())
            losses[loss_id] = loss
            while len(losses) > self.max_per_user:
                losses.popitem(last=False)

    def get(self, user_id: str, loss_id: str) -> CustomLoss | None:
        """The user's own loss; None if unknown or another user's (indistinguishable on purpose)."""
        with self._lock:
            losses = self._users.get(user_id)
            return None if losses is None else losses.get(loss_id)


def store(request: Request) -> CustomLossStore:
    """The server's one store (on the app's state, made at first use)."""
    state = request.app.state
    if not hasattr(state, "tinker_custom_losses"):
        state.tinker_custom_losses = CustomLossStore()
    return state.tinker_custom_losses  # type: ignore[no-any-return]  # Starlette's state is untyped


async def create_custom_loss(request: Request, user: User) -> UntypedAPIFuture:
    """Checked at submit: a graph off the list is a 400 naming its node; the future answers {loss_id}."""
    data = await body(request)
    svc = services(request)
    session_id = string(data, "session_id", "") or ""
    seq = integer(data.get("custom_loss_seq_id"), "custom_loss_seq_id", 0)
    await svc.tinker_sessions.open(user, session_id)
    loss = parse_custom_loss({"name": data.get("name"), "inputs": data.get("inputs"), "graph": data.get("graph")},
                             field="")
    loss_id = f"{session_id}:loss:{seq}"
    losses = store(request)

    async def work(request_id: str) -> tuple[str, bytes]:
        losses.put(user.id, loss_id, loss)
        return json_answer({"loss_id": loss_id, "type": "create_custom_loss"})

    row = await svc.tinker.submit(user, ("loss", session_id, seq), "CreateCustomLoss", work)
    return future_answer(row)


def graph_for(request: Request, user: User, model_id: str, loss_fn: str,
              config: dict[str, float | str] | None) -> JSONObject | None:
    """loss_fn "custom": the graph its loss_id names, which must be this user's and this model's session's."""
    if loss_fn != "custom":
        return None
    config = dict(config or {})
    loss_id = config.pop("loss_id", None)
    if not isinstance(loss_id, str) or not loss_id:
        raise BadInput("loss_fn 'custom' takes loss_fn_config {loss_id} from create_custom_loss",
                       field="loss_fn_config.loss_id")
    if config:
        raise BadInput(f"loss_fn 'custom' takes only loss_id, got {sorted(config)[0]!r}", field="loss_fn_config")
    loss = store(request).get(user.id, loss_id)
    if loss is None or session_of(loss_id) != session_of(model_id):
        raise NotFound(f"custom loss {loss_id!r} not found in this session", field="loss_fn_config.loss_id")
    return loss.to_dict()
