"""Transports for SDK tests at the network boundary: what a flaky connection does to a call."""

from __future__ import annotations

import json
from typing import Any

import httpx


class DropFirstAnswer(httpx.HTTPTransport):
    """The network boundary: forwards every request, and loses the first answer to `operation` after the server
    has applied it, as a connection that drops at the wrong moment does."""

    def __init__(self, operation: str) -> None:
        super().__init__()
        self.operation = operation
        self.sent: list[dict[str, Any]] = []  # the variables of each attempt at `operation`

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        payload = json.loads(request.content)
        if payload.get("operationName") == self.operation:
            self.sent.append(payload["variables"])
            if len(self.sent) == 1:
                response.read()
                response.close()
                raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        return response
