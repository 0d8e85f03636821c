"""Applied means recorded, once (issue 19 §5).

Each call the runtime applied is recorded in one transaction keyed by (run_id, request_id): its `call_records` row
(operation, compute seconds, GPUs, tokens in and out, time), and what the call itself records (metric rows,
`runs.step`, samples, checkpoint rows), `runs.compute_seconds` and the billing outbox row (the ledger's). A retry of
the call (the runtime replays its answer) finds the row and writes nothing; a call whose first answer was lost, with
nothing recorded, is recorded whole by its retry. Two server processes recording one call: the second's insert of
the key fails, and its transaction writes nothing.

A database that cannot take the transaction (locked, read-only, unreachable) is retried for SIGNAL_RECORD_RETRY_S,
then the call answers UNAVAILABLE: it was applied, and its retry with the same request id records it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Database, database_error
from app.errors import Unavailable
from app.services.ledger import Ledger, billing_key, charge, user_key
from app.tables import CallRecord, Run, utcnow
from gpu_runtime.contract import ForwardBackwardResult, ForwardResult, Result, SampleResult

T = TypeVar("T")
log = logging.getLogger("signal.records")

FIRST_RETRY_S = 0.05  # the first wait before recording again; doubled each time…
LONGEST_RETRY_S = 1.0  # …up to this


@dataclass(frozen=True)
class Caller:
    """Whose call it is and what it ran on: a run, or a base model alone (run None, priced by its pool's device)."""

    user_id: str
    run: Run | None = None
    base_model: str = ""
    device: str = ""
    gpu_config: str = ""

    @classmethod
    def of(cls, run: Run) -> Caller:
        return cls(run.user_id, run, run.base_model, run.device, run.gpu_config)


# What a call records besides its call record: given the open transaction and whether this is the call's first
# recording (False: recorded before, so only reads are wanted), it returns the caller's answer.
Write = Callable[[AsyncSession, bool], Awaitable[T]]


def tokens(result: Result) -> tuple[int, int]:
    """(tokens in, tokens out) of an answer: a training call's weighted target tokens, a sample's prompt tokens (each
    prompt once per sequence made from it) and generated tokens; none for the others."""
    if isinstance(result, (ForwardBackwardResult, ForwardResult)):
        return result.num_tokens, 0
    if isinstance(result, SampleResult):
        sequences = result.sequences
        tokens_in = sum(len(prompt) * len(made) for prompt, made in zip(result.prompt_tokens, sequences))
        return tokens_in, sum(len(sequence.tokens) for made in sequences for sequence in made)
    return 0, 0


class CallRecorder:
    def __init__(self, db: Database, ledger: Ledger, retry_s: float) -> None:
        self.db = db
        self.ledger = ledger
        self.retry_s = retry_s  # SIGNAL_RECORD_RETRY_S

    async def record(self, caller: Caller, operation: str, request_id: str, result: Result,
                     write: Write[T], after: Callable[[], None] | None = None) -> T:
        """Record an applied call once (see the module's doc); `after` runs once its first recording committed."""
        deadline = time.monotonic() + self.retry_s
        delay = FIRST_RETRY_S
        while True:
            try:
                answer, fresh = await self._once(caller, operation, request_id, result, write)
            except Exception as exc:
                error = database_error(exc)
                if not isinstance(error, Unavailable):
                    raise
                if time.monotonic() + delay > deadline:
                    raise Unavailable(f"{error.message}: the call was applied but not recorded; send it again with "
                                      "the same requestId to record it") from None
                log.warning("recording %s %s failed (%s); trying again", operation, request_id, error.message)
                await asyncio.sleep(delay)  # a backoff between attempts, not a wait for an event
                delay = min(delay * 2, LONGEST_RETRY_S)
                continue
            if fresh:
                self.ledger.drain_soon()
                if after is not None:
                    after()
            return answer

    async def _once(self, caller: Caller, operation: str, request_id: str, result: Result,
                    write: Write[T]) -> tuple[T, bool]:
        key = billing_key(caller.run.id, request_id) if caller.run else user_key(caller.user_id, request_id)
        fresh = True
        try:
            async with self.db.session() as session:
                fresh = await session.get(CallRecord, key) is None
                if fresh:
                    session.add(self._row(caller, key, operation, request_id, result))
                    await session.flush()  # another process's row for this key fails here, before anything else
                answer = await write(session, fresh)
                if fresh:
                    seconds = _seconds(result)
                    if caller.run is not None:
                        await self.ledger.owe(session, caller.run, operation, request_id, seconds)
                    elif operation == "sample":  # a base-model sample is billed to its user; a forward is free
                        await self.ledger.owe_user(session, caller.user_id, operation, request_id, seconds,
                                                   caller.device, caller.gpu_config)
        except IntegrityError:
            if not fresh:
                raise
            # Another server process recorded this call first: what it wrote stands, read as a retry's.
            async with self.db.session() as session:
                return await write(session, False), False
        return answer, fresh

    def _row(self, caller: Caller, key: str, operation: str, request_id: str, result: Result) -> CallRecord:
        seconds = _seconds(result)
        owed = charge(Run(device=caller.device, gpu_config=caller.gpu_config), seconds, self.ledger.rates)
        tokens_in, tokens_out = tokens(result)
        tokens_cached = result.prompt_cache_hit_tokens if isinstance(result, SampleResult) else 0
        return CallRecord(
            key=key, user_id=caller.user_id, run_id=caller.run.id if caller.run else None, request_id=request_id,
            operation=operation, base_model=caller.base_model, compute_seconds=seconds, device=owed.device,
            gpu_type=owed.gpu_type, gpu_count=owed.gpu_count, gpu_seconds=owed.gpu_seconds, credits=owed.credits,
            tokens_in=tokens_in, tokens_out=tokens_out, tokens_cached=tokens_cached, created_at=utcnow())


def _seconds(result: Result) -> float:
    return max(float(getattr(result, "compute_seconds", 0.0)), 0.0)  # the calls that compute carry it
