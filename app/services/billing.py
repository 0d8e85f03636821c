"""Billing hooks: the client of the billing service at FRONTIER_BACKEND_URL (the contract: docs/BILLING.md).
What a call costs, and when it is owed, is the ledger's (app/services/ledger.py); this module only talks.

- `validate` asks /internal/validate-credits before createRun and before each training primitive; a refusal is
  INSUFFICIENT_CREDITS, a service that cannot be asked is BILLING_UNAVAILABLE, and either way nothing runs.
- `hf_token` asks /internal/get-integrations when a push to the Hub needs the user's token and the call brought
  none; the token goes to that one runtime call and is neither stored nor logged.
- Deductions go through the `billing_outbox` table: the ledger writes a row per applied call, keyed by the call's
  idempotency key, and `drain` sends the unsent rows to /internal/deduct-credits (after each call, at start, and
  every SIGNAL_BILLING_RETRY_S). A row is marked sent on 2xx or 409 (the service already has that key), so a
  retry, a second server process or a crash between the send and the mark never charges twice, and a crash
  before the send is charged after the restart.

Only built when FRONTIER_BACKEND_URL is set; otherwise the ledger has no billing and makes no calls at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
from sqlalchemy import select

from app.db import Database
from app.errors import BillingUnavailable, InsufficientCredits
from app.settings import Settings
from app.tables import BillingOutbox, utcnow
from gpu_runtime.contract.json_types import JSONObject

log = logging.getLogger("signal.billing")

VALIDATE_PATH = "/internal/validate-credits"
INTEGRATIONS_PATH = "/internal/get-integrations"
DEDUCT_PATH = "/internal/deduct-credits"
REFUSED = (402, 403)  # validate-credits: the user may not spend (besides 200 with "allowed": false)
DRAIN_BATCH = 500  # rows sent per drain round


class BillingClient:
    def __init__(self, settings: Settings, db: Database) -> None:
        self.db = db
        self.base_url = settings.frontier_backend_url.strip().rstrip("/")
        self.timeout = settings.billing_timeout_s
        self.retry_s = settings.billing_retry_s
        headers = {"Authorization": f"Bearer {settings.billing_secret}"} if settings.billing_secret else {}
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout)
        self._drain_lock = asyncio.Lock()
        self._drain_pending = False  # a drain is scheduled and has not yet read the outbox
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ---- before a call --------------------------------------------------------------------

    async def validate(self, ask: JSONObject) -> None:
        """Raise InsufficientCredits or BillingUnavailable unless the billing service allows the call `ask`
        describes (its fields: docs/BILLING.md; the ledger writes them)."""
        response = await self._post(VALIDATE_PATH, ask)
        if response.status_code in REFUSED:
            raise InsufficientCredits(_message(response, "the billing service refused: not enough credits"))
        if response.status_code != 200:
            raise BillingUnavailable(f"the billing service answered {VALIDATE_PATH} with HTTP {response.status_code}"
                                     + (" (SIGNAL_BILLING_SECRET is not the one it expects)"
                                        if response.status_code == 401 else ""))
        allowed = _json(response).get("allowed")
        if allowed is False:
            raise InsufficientCredits(_message(response, "not enough credits for this call"))
        if allowed is not True:
            raise BillingUnavailable(f"the billing service's answer to {VALIDATE_PATH} has no boolean `allowed`")

    async def hf_token(self, user_id: str) -> str | None:
        """The user's Hugging Face token from the billing service's integrations, or None when it has none."""
        response = await self._post(INTEGRATIONS_PATH, {"user_id": user_id, "integrations": ["huggingface"]})
        if response.status_code == 404:
            return None  # the billing service knows no integrations for this user
        if response.status_code != 200:
            raise BillingUnavailable(f"the billing service answered {INTEGRATIONS_PATH} with HTTP "
                                     f"{response.status_code}")
        huggingface = _json(response).get("huggingface")
        token = huggingface.get("token") if isinstance(huggingface, dict) else None
        return token if isinstance(token, str) and token.strip() else None

    async def _post(self, path: str, body: JSONObject) -> httpx.Response:
        try:
            return await self.http.post(path, json=body)
        except httpx.TimeoutException:
            raise BillingUnavailable(f"the billing service did not answer {path} within {self.timeout:g}s") from None
        except httpx.HTTPError as error:
            raise BillingUnavailable(f"the billing service at {self.base_url} is unreachable: "
                                     f"{type(error).__name__}") from None

    # ---- after a call: the outbox ----------------------------------------------------------

    def start(self) -> None:
        """At server start: send what earlier processes left owed, then keep retrying every SIGNAL_BILLING_RETRY_S."""
        self.drain_soon()
        self._spawn(self._retry_forever())

    def drain_soon(self) -> None:
        """Schedule a drain (after each call); one already scheduled and not yet reading covers new rows."""
        if self._closed or self._drain_pending:
            return
        self._drain_pending = True
        self._spawn(self.drain())

    async def drain(self) -> int:
        """Send every unsent deduction; returns how many the billing service took. Stops the round at the first failure to
        reach it (the rest wait for the next round)."""
        async with self._drain_lock:
            self._drain_pending = False
            async with self.db.session() as session:
                rows = list(await session.scalars(select(BillingOutbox).where(BillingOutbox.sent_at.is_(None))
                                                  .order_by(BillingOutbox.created_at).limit(DRAIN_BATCH)))
            settled = 0
            for row in rows:
                error = await self._deduct(row)
                async with self.db.session() as session:
                    stored = await session.get(BillingOutbox, row.idempotency_key)
                    if stored is not None:
                        stored.attempts += 1
                        stored.last_error = error or ""
                        if error is None:
                            stored.sent_at = utcnow()
                if error is not None:
                    log.warning("deduction %s not taken yet (%s); it is sent again later", row.idempotency_key, error)
                    break
                settled += 1
            return settled

    async def _deduct(self, row: BillingOutbox) -> str | None:
        """Send one deduction; None when the billing service has it (now or before), else why not."""
        try:
            response = await self.http.post(DEDUCT_PATH, json={
                "idempotency_key": row.idempotency_key, "user_id": row.user_id, "run_id": row.run_id,
                "operation": row.operation, "compute_seconds": row.compute_seconds, "device": row.device or None,
                "gpu_type": row.gpu_type,
                "gpu_count": row.gpu_count, "gpu_seconds": row.gpu_seconds, "credits": row.credits,
                "occurred_at": row.created_at.isoformat(),
            })
        except httpx.HTTPError as error:
            return f"unreachable: {type(error).__name__}"
        if 200 <= response.status_code < 300 or response.status_code == 409:  # 409: a duplicate key, already taken
            return None
        return f"HTTP {response.status_code}"

    async def _retry_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.retry_s)
            self.drain_soon()

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(self._logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _logged(work: Any) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed round (the database, say) is retried by the next one
            log.exception("billing outbox drain failed")

    async def close(self) -> None:
        """Stop draining (rows not yet marked sent are sent again by the next start) and close the client."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.http.aclose()


def _json(response: httpx.Response) -> JSONObject:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _message(response: httpx.Response, default: str) -> str:
    """The billing service's own words for a refusal (its `message`), shown to the user as they are."""
    message = _json(response).get("message")
    return message.strip()[:500] if isinstance(message, str) and message.strip() else default
