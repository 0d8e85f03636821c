"""For type checkers: a method written once on the shared bases (ClientBase, RunBase) answers S on a `Blocking` owner
(SignalClient, Run) and a coroutine of A on an `Awaiting` one (AsyncSignalClient, AsyncRun: it returns `_run`'s
awaitable there). The owners are named by these marker bases, so this module imports none of them.

At run time each decorator hands the method back unchanged: the clients' behaviour does not depend on its typing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
S = TypeVar("S")  # a method's answer on the sync client (and Run)
A = TypeVar("A")  # the same method's answer, awaited, on the async client (and AsyncRun)


class Owner:
    """What holds `Answers` methods: the shared bases, ClientBase and RunBase."""


class Blocking(Owner):
    """An owner whose methods answer at once: SignalClient and Run."""


class Awaiting(Owner):
    """An owner whose methods answer awaitables: AsyncSignalClient and AsyncRun."""


if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any, Concatenate, Self, overload

    class Answers(Generic[P, S, A]):
        def __init__(self, method: Callable[Concatenate[Any, P], Any]) -> None: ...

        @overload
        def __get__(self, owner: None, cls: type) -> Self: ...
        @overload
        def __get__(self, owner: Blocking, cls: type) -> Callable[P, S]: ...
        @overload
        def __get__(self, owner: Awaiting, cls: type) -> Callable[P, Coroutine[Any, Any, A]]: ...
        @overload
        def __get__(self, owner: Owner, cls: type) -> Callable[P, Any]: ...
        def __get__(self, owner: object, cls: type) -> Any: ...

    def answers(answer: type[S]) -> Callable[[Callable[Concatenate[Any, P], Any]], Answers[P, S, S]]: ...
else:
    def answers(answer):
        return lambda method: method
