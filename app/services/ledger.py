"""What runs cost: compute seconds → credits by the run's device, and each call accounted once (docs/BILLING.md).

Every applied call adds its compute seconds to its run, billing on or off. With the billing service configured
(FRONTIER_BACKEND_URL), the ledger also asks it before each call and owes it each applied call, through the
`billing_outbox` row written in the same transaction, keyed by the call's idempotency key.

A run on the CPU (device `cpu`) is charged its compute seconds at SIGNAL_CPU_SECOND_RATE and has no GPU-seconds;
a run on a GPU is charged GPU-seconds (compute seconds × the GPUs of its pool, `gpuConfig`) at
SIGNAL_GPU_SECOND_RATE. A run older than the device column is charged as on its pool's GPUs, as it was then.

A sample of a base model alone has no run. It is billed to its user (`allow_user`, `owe_user`): with billing on,
a deduction keyed `user:{user_id}:{request_id}` with an empty run_id, priced by the device of the pool's runtime; its
compute seconds are in that outbox row only. No run's `compute_seconds` grows, and with billing off they are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Database
from app.services.billing import BillingClient
from app.settings import Settings
from app.tables import BillingOutbox, Run, User, utcnow
from gpu_runtime.client.allocation import GpuAllocation, parse_gpu_config
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.errors import BadInput

CPU = "cpu"  # the runtime's name for the CPU device (str(torch.device("cpu")))


@dataclass(frozen=True)
class Rates:
    gpu_second: float  # credits per GPU-second
    cpu_second: float  # credits per compute second on the CPU

    @classmethod
    def of(cls, settings: Settings) -> Rates:
        return cls(gpu_second=settings.gpu_second_rate, cpu_second=settings.cpu_second_rate)


@dataclass(frozen=True)
class Charge:
    """What some compute seconds of one run cost, as the billing service is told."""

    device: str
    gpu_type: str  # "cpu" on the CPU
    gpu_count: int  # 0 on the CPU
    gpu_seconds: float
    credits: float


def allocation_of(gpu_config: str) -> GpuAllocation:
    """The run's GPUs; a run stored without a (valid) configuration counts as one GPU of unknown type."""
    try:
        return parse_gpu_config(gpu_config)
    except BadInput:
        return GpuAllocation(gpu_config or "unknown", 1)


def hardware(device: str, gpu_config: str) -> tuple[str, int]:
    """(gpu_type, gpu_count) of what a run trains on: ("cpu", 0) on the CPU, else its pool's GPUs."""
    if device == CPU:
        return CPU, 0
    gpus = allocation_of(gpu_config)
    return gpus.gpu_type, gpus.count


def charge(run: Run, compute_seconds: float, rates: Rates) -> Charge:
    seconds = max(float(compute_seconds or 0.0), 0.0)
    gpu_type, count = hardware(run.device, run.gpu_config)
    if count == 0:
        return Charge(run.device, gpu_type, 0, 0.0, seconds * rates.cpu_second)
    return Charge(run.device, gpu_type, count, seconds * count, seconds * count * rates.gpu_second)


def gpu_seconds(run: Run) -> float:
    """Compute seconds × the GPUs it trains on (0 on the CPU): what a GPU run costs, before the rate."""
    return charge(run, run.compute_seconds, Rates(0.0, 0.0)).gpu_seconds


def billing_key(run_id: str, request_id: str) -> str:
    """A call's idempotency key for billing: request ids are unique per run (the runtime dedupes them per run)."""
    return f"{run_id}:{request_id}"


def user_key(user_id: str, request_id: str) -> str:
    """A call on no run's idempotency key for billing (a base-model sample)."""
    return f"user:{user_id}:{request_id}"


class Ledger:
    def __init__(self, db: Database, rates: Rates, billing: BillingClient | None = None) -> None:
        self.db = db
        self.rates = rates
        self.billing = billing  # None: FRONTIER_BACKEND_URL unset, no billing calls at all

    def cost(self, run: Run) -> Charge:
        """The run's usage so far, at the server's current rates."""
        return charge(run, run.compute_seconds, self.rates)

    async def allow_create(self, user: User, run_id: str, gpu_config: str, base_model: str) -> None:
        """Before createRun: the device is not known until the runtime made the run, so the request is priced."""
        if self.billing is not None:
            gpu_type, count = hardware("", gpu_config)
            await self.billing.validate(self._ask(user, "create_run", run_id, base_model, "", gpu_type, count))

    async def allow(self, user: User, run: Run, operation: str, request_id: str) -> str:
        """With billing on, ask the billing service before the call (its request id, which the server gives a call
        the client sent without one, is its deduction's key); a retry of a call already charged is not asked about
        again. Returns the request id."""
        if self.billing is None:
            return request_id
        async with self.db.session() as session:
            charged = await session.get(BillingOutbox, billing_key(run.id, request_id))
        if charged is None:
            gpu_type, count = hardware(run.device, run.gpu_config)
            await self.billing.validate(self._ask(user, operation, run.id, run.base_model, run.device, gpu_type,
                                                  count))
        return request_id

    async def owe(self, session: AsyncSession, run: Run, operation: str, request_id: str, seconds: float) -> None:
        """Inside the call's recording transaction (call_records.py), which runs once per call: add its compute
        seconds to the run and, with billing on, owe them through the outbox, keyed by the call's idempotency key
        (a row already there, written before call records existed, is not written again). `drain_soon` after commit."""
        if self.billing is not None:
            key = billing_key(run.id, request_id)
            if await session.get(BillingOutbox, key) is None:
                session.add(self._deduction(run, operation, key, seconds))
        await session.execute(update(Run).where(Run.id == run.id)
                              .values(compute_seconds=Run.compute_seconds + seconds))

    async def allow_user(self, user: User, operation: str, request_id: str, base_model: str, gpu_config: str) -> str:
        """`allow` for a call on no run (a base-model sample): asked about as the user's, on the pool's GPUs."""
        if self.billing is None:
            return request_id
        async with self.db.session() as session:
            charged = await session.get(BillingOutbox, user_key(user.id, request_id))
        if charged is None:
            gpu_type, count = hardware("", gpu_config)
            await self.billing.validate(self._ask(user, operation, "", base_model, "", gpu_type, count))
        return request_id

    async def owe_user(self, session: AsyncSession, user_id: str, operation: str, request_id: str, seconds: float,
                       device: str, gpu_config: str) -> None:
        """`owe` for a call on no run, to the user (billing on); there is no run to add its seconds to."""
        key = user_key(user_id, request_id)
        if self.billing is None or await session.get(BillingOutbox, key) is not None:
            return
        owed = charge(Run(device=device, gpu_config=gpu_config), seconds, self.rates)
        session.add(BillingOutbox(
            idempotency_key=key, user_id=user_id, run_id="", operation=operation, compute_seconds=seconds,
            device=owed.device, gpu_type=owed.gpu_type, gpu_count=owed.gpu_count, gpu_seconds=owed.gpu_seconds,
            credits=owed.credits, created_at=utcnow(), attempts=0, last_error=""))

    def drain_soon(self) -> None:
        """After a recording transaction committed: send what it owes."""
        if self.billing is not None:
            self.billing.drain_soon()

    def _deduction(self, run: Run, operation: str, key: str, seconds: float) -> BillingOutbox:
        owed = charge(run, seconds, self.rates)
        return BillingOutbox(
            idempotency_key=key, user_id=run.user_id, run_id=run.id, operation=operation, compute_seconds=seconds,
            device=owed.device, gpu_type=owed.gpu_type, gpu_count=owed.gpu_count, gpu_seconds=owed.gpu_seconds,
            credits=owed.credits, created_at=utcnow(), attempts=0, last_error="",
        )

    def _ask(self, user: User, operation: str, run_id: str, base_model: str, device: str, gpu_type: str,
             gpu_count: int) -> JSONObject:
        return {"user_id": user.id, "operation": operation, "run_id": run_id, "base_model": base_model,
                "device": device or None, "gpu_type": gpu_type, "gpu_count": gpu_count,
                "credits_per_gpu_second": self.rates.gpu_second, "credits_per_cpu_second": self.rates.cpu_second}
