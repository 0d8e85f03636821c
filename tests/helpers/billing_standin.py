"""A stand-in for the billing backend, FOR TESTS ONLY: it is not a billing service and not part of Signal.

The real backend (FRONTIER_BACKEND_URL) cannot be reached from here, so the tests run Signal against this
implementation of the contract in docs/BILLING.md: a threading HTTP server on 127.0.0.1 that answers

- POST /internal/validate-credits   by `validate`: "approve" (200 allowed), "refuse" (402 with a message),
                                    "refuse_200" (200 allowed: false), "hang" (answers nothing until released),
                                    "error" (500);
- POST /internal/get-integrations   from `hf_tokens` (user id → token; 404 for a user without one);
- POST /internal/deduct-credits     by `deduct`: "approve" (200; a key seen before: 409 and not charged again),
                                    "error" (500, nothing taken), "lost_answer" (takes it, then answers 500, as a
                                    reply lost on the way back does);

and 401 for a request without `Authorization: Bearer {secret}`. It records every request, and `wait_until`
lets a test wait for one (a condition variable, bounded; never a fixed sleep).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANG_LIMIT_S = 60  # a hanging request answers after this at the latest, so a failed test never blocks forever


@dataclass
class BillingStandIn:
    secret: str
    validate: str = "approve"
    deduct: str = "approve"
    hf_tokens: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body), in arrival order
    charged: dict[str, dict[str, Any]] = field(default_factory=dict)  # idempotency key → the deduction taken
    duplicates: list[str] = field(default_factory=list)  # keys sent again after they were taken
    release: threading.Event = field(default_factory=threading.Event)  # ends every "hang"
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> BillingStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                status, answer = standin._answer(self.path, self.headers.get("Authorization"), body)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): as a real backend would see it

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _answer(self, path: str, authorization: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if authorization != f"Bearer {self.secret}":
            return self._done(path, body, 401, {"message": "bad secret"})
        if path == "/internal/validate-credits":
            if self.validate == "hang":
                self._record(path, body)
                self.release.wait(HANG_LIMIT_S)
                return 200, {"allowed": True}
            answers: dict[str, tuple[int, dict[str, Any]]] = {"approve": (200, {"allowed": True, "balance": 100.0}),
                       "refuse": (402, {"message": "Your balance is 0 credits: top up to keep training."}),
                       "refuse_200": (200, {"allowed": False, "message": "Credits exhausted."}),
                       "error": (500, {"message": "database down"})}
            return self._done(path, body, *answers[self.validate])
        if path == "/internal/get-integrations":
            token = self.hf_tokens.get(body.get("user_id", ""))
            if token is None:
                return self._done(path, body, 404, {})
            return self._done(path, body, 200, {"huggingface": {"token": token}, "wandb": {"api_key": "w"}})
        if path == "/internal/deduct-credits":
            key = body["idempotency_key"]
            if self.deduct == "error":
                return self._done(path, body, 500, {"message": "try later"})
            with self._changed:
                seen = key in self.charged
                if seen:
                    self.duplicates.append(key)
                else:
                    self.charged[key] = body
            if seen:
                return self._done(path, body, 409, {"message": "duplicate idempotency_key"})
            if self.deduct == "lost_answer":
                return self._done(path, body, 500, {"message": "taken, but the answer is lost"})
            return self._done(path, body, 200, {"balance": 99.0})
        return self._done(path, body, 404, {})

    def _record(self, path: str, body: dict[str, Any]) -> None:
        with self._changed:
            self.requests.append((path, body))
            self._changed.notify_all()

    def _done(self, path: str, body: dict[str, Any], status: int, answer: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._record(path, body)
        return status, answer

    # ---- reading what arrived ----------------------------------------------------------------

    def calls(self, path: str, **match: Any) -> list[dict[str, Any]]:
        """Bodies of the requests to `path` whose fields equal `match` (user_id=…, run_id=…)."""
        with self._changed:
            return [body for p, body in self.requests
                    if p == path and all(body.get(k) == v for k, v in match.items())]

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
        with self._changed:
            if not self._changed.wait_for(condition, timeout=timeout):
                raise TimeoutError(f"timed out waiting for {what}")
