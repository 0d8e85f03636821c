"""For type checkers: a method written once on the shared bases (ClientBase, RunBase) answers S on SignalClient and
Run, and a coroutine of A on AsyncSignalClient and AsyncRun (it returns `_run`'s awaitable there).

At run time each decorator hands the method back unchanged: the clients' behaviour does not depend on its typing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
S = TypeVar("S")  # a method's answer on the sync client (and Run)
A = TypeVar("A")  # the same method's answer, awaited, on the async client (and AsyncRun)

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any, Concatenate, Self, overload

    from rewardsignal.async_client import AsyncSignalClient
    from rewardsignal.client_base import ClientBase
    from rewardsignal.runs import AsyncRun, Run, RunBase
    from rewardsignal.sync_client import SignalClient

    class Answers(Generic[P, S, A]):
        def __init__(self, method: Callable[Concatenate[Any, P], Any]) -> None: ...

        @overload
        def __get__(self, owner: None, cls: type) -> Self: ...
        @overload
        def __get__(self, owner: SignalClient | Run, cls: type) -> Callable[P, S]: ...
        @overload
        def __get__(self, owner: AsyncSignalClient | AsyncRun, cls: type) -> Callable[P, Coroutine[Any, Any, A]]: ...
        @overload
        def __get__(self, owner: ClientBase | RunBase, cls: type) -> Callable[P, Any]: ...
        def __get__(self, owner: object, cls: type) -> Any: ...

    def answers(answer: type[S]) -> Callable[[Callable[Concatenate[Any, P], Any]], Answers[P, S, S]]: ...
    def answers_run(method: Callable[Concatenate[Any, P], Any]) -> Answers[P, Run, AsyncRun]: ...
    def answers_runs(method: Callable[Concatenate[Any, P], Any]) -> Answers[P, list[Run], list[AsyncRun]]: ...
else:
    def answers(answer):
        return lambda method: method

    def answers_run(method):
        return method

    answers_runs = answers_run
