"""rewardsignal: the Python SDK for Signal's training API (httpx only).

    from rewardsignal import SignalClient
    client = SignalClient()  # reads SIGNAL_API_KEY and SIGNAL_BASE_URL (default http://localhost:8000)
    run = client.create_run(lora_r=32)
    run.forward_backward(batch=[{"text": "hello"}]); run.optim_step()
"""

from rewardsignal.client import Artifact, AsyncRun, AsyncSignalClient, Run, SignalClient
from rewardsignal.datums import pack_datum
from rewardsignal.errors import (
    AuthenticationError,
    BadInputError,
    BillingUnavailableError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    ForbiddenError,
    HubError,
    InsufficientCreditsError,
    ModelUnavailableError,
    NotFoundError,
    PayloadTooLargeError,
    ResourceExhaustedError,
    ServerError,
    SignalAPIError,
    TransportError,
    UnavailableError,
    WorkerFailedError,
)
from rewardsignal.results import Result

__all__ = [
    "Artifact",
    "AsyncRun",
    "AsyncSignalClient",
    "AuthenticationError",
    "BadInputError",
    "BillingUnavailableError",
    "CancelledError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "ForbiddenError",
    "HubError",
    "InsufficientCreditsError",
    "ModelUnavailableError",
    "NotFoundError",
    "PayloadTooLargeError",
    "ResourceExhaustedError",
    "Result",
    "Run",
    "ServerError",
    "SignalAPIError",
    "SignalClient",
    "TransportError",
    "UnavailableError",
    "WorkerFailedError",
    "pack_datum",
]
