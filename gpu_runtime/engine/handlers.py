"""The engine's table of calls answered in one go (all but forward_backward and sample, which are the tick's passes):
one handler per contract type, each checked against the type it answers, so adding a call is its contract type
and one `add`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from gpu_runtime.contract import Call, Result
from gpu_runtime.contract.calls import A

C = TypeVar("C", bound=Call)


class Handlers:
    def __init__(self) -> None:
        self._table: dict[type[Call], Callable[[Any], Result]] = {}

    def add(self, kind: type[C], handler: Callable[[C], Result]) -> Handlers:
        assert kind not in self._table, f"{kind.__name__} has a handler already"
        self._table[kind] = handler
        return self

    def answer(self, call: Call[A]) -> A:
        """The call's result, of its type's `answer` (checked here: the table's types cannot say it)."""
        result = self._table[type(call)](call)
        assert isinstance(result, type(call).answer), f"{type(call).__name__} answered {type(result).__name__}"
        return cast(A, result)

    @property
    def kinds(self) -> frozenset[type[Call]]:
        return frozenset(self._table)
