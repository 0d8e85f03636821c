"""SignalClient and AsyncSignalClient: the same surface, one blocking and one awaitable.

Each public method builds a `Call` (operation, variables, the field to return, how to wrap it: calls.py), written
once on the shared bases (client_base.py, runs.py); the sync client runs it at once (sync_client.py), the async
client returns an awaitable that does (async_client.py). Both send it through transport.py (the GraphQL request,
its answer, retries with the same requestId) and number a run's calls as they are made (pipelining.py).
Checkpoints come back as `Artifact`s (artifacts.py). This module keeps the names callers import from it.
"""

from rewardsignal.artifacts import Artifact
from rewardsignal.async_client import AsyncSignalClient
from rewardsignal.calls import graphql_batch as _batch
from rewardsignal.errors import SignalAPIError
from rewardsignal.runs import AsyncRun, Run
from rewardsignal.sync_client import SignalClient

__all__ = ["Artifact", "AsyncRun", "AsyncSignalClient", "Run", "SignalAPIError", "SignalClient", "_batch"]
