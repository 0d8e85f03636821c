"""Tickets order one run's calls across server processes: the scheduler alone, no engine, no torch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from gpu_runtime.client.protocol import answer_message, split_ticket
from gpu_runtime.contract import Call, CancelResult, CreateRun, OptimStep
from gpu_runtime.engine.request import Answer, Request
from gpu_runtime.engine.scheduler import Scheduler, cancel_error
from gpu_runtime.errors import BadInput

RUN = "run-1"


def typed(method: str, run_id: str, request_id: str | None = None) -> Call:
    if method == "create_run":
        return CreateRun(run_id=run_id, user_id="user", base_model="base")
    return OptimStep(run_id=run_id, request_id=request_id)


def wire(answers: list[dict[str, Any]]) -> Callable[[Answer], None]:
    """Keep each answer as the wire carries it."""
    return lambda answer: answers.append(answer_message(answer))


def call(ticket: int | None, method: str = "optim_step", run_id: str = RUN) -> Request:
    return Request(typed(method, run_id), lambda answer: None, user_id="user", run_id=run_id, ticket=ticket)


def tick(scheduler: Scheduler) -> list[int | None]:
    """One tick's picks, answered: their tickets."""
    picks = [pick.request for pick in scheduler.next_tick(lambda request: 0).picks]
    for request in picks:
        scheduler.finish(request, CancelResult(found=True))
    return [request.ticket for request in picks]


def created(scheduler: Scheduler) -> Scheduler:
    scheduler.submit(call(None, "create_run"))
    assert tick(scheduler) == [None]
    return scheduler


def test_calls_apply_in_ticket_order_whatever_order_they_arrive_in() -> None:
    scheduler = created(Scheduler(tick_tokens=1024))
    for ticket in (3, 2):
        scheduler.submit(call(ticket))
    assert not scheduler.has_work()  # ticket 1 has not arrived: 2 and 3 wait for it
    scheduler.submit(call(1))
    assert [tick(scheduler) for _ in range(3)] == [[1], [2], [3]]


def test_a_ticket_that_never_comes_is_waited_for_at_most_ticket_wait(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = created(Scheduler(tick_tokens=1024, ticket_wait=0.2))
    scheduler.submit(call(2))  # ticket 1's server died between its ticket and its call
    assert not scheduler.has_work()
    # wait_for_work wakes when the hold runs out, not at its (longer) timeout.
    with caplog.at_level(logging.WARNING, logger="gpu_runtime.engine.scheduler"):
        assert scheduler.wait_for_work(timeout=30)
        assert tick(scheduler) == [2]
    assert "tickets 1..1 did not arrive" in caplog.text
    scheduler.submit(call(1))  # late after all: it goes when it comes
    scheduler.submit(call(3))
    assert tick(scheduler) == [1] and tick(scheduler) == [3]


def test_a_runtime_that_has_not_seen_the_run_starts_from_the_first_ticket() -> None:
    scheduler = Scheduler(tick_tokens=1024)  # e.g. restarted since the run was created
    scheduler.submit(call(41))
    assert tick(scheduler) == [41]
    scheduler.submit(call(43))
    assert not scheduler.has_work()
    scheduler.submit(call(42))
    assert tick(scheduler) == [42] and tick(scheduler) == [43]


def test_calls_without_tickets_keep_arrival_order() -> None:
    scheduler = created(Scheduler(tick_tokens=1024))
    for _ in range(3):
        scheduler.submit(call(None))
    assert [tick(scheduler) for _ in range(3)] == [[None]] * 3


@pytest.mark.parametrize("ticket", [0, -1, 1.5, "2", True])
def test_a_ticket_is_a_positive_integer(ticket: Any) -> None:
    with pytest.raises(BadInput) as refused:
        split_ticket({"run_id": RUN, "ticket": ticket})
    assert refused.value.field == "ticket"
    assert split_ticket({"run_id": RUN, "ticket": 7}) == ({"run_id": RUN}, 7)


def test_a_refused_calls_ticket_is_not_waited_for() -> None:
    """A call refused for too many in flight never applied: the run's next ticket (its resend's) goes at once, not
    after ticket_wait; a resend carrying the refused ticket itself goes at once too."""
    scheduler = created(Scheduler(tick_tokens=1024, user_calls=1, user_queue=0))
    answers: list[dict[str, Any]] = []
    scheduler.submit(call(None, run_id="run-2"))  # the user's one place
    scheduler.submit(Request(typed("optim_step", RUN), wire(answers), user_id="user", run_id=RUN, ticket=1))
    assert [answer["error"]["details"]["resource"] for answer in answers] == ["calls"]
    assert tick(scheduler) == [None]  # the place is free again
    scheduler.submit(call(2))
    assert tick(scheduler) == [2]
    scheduler.submit(call(1))
    assert tick(scheduler) == [1]


@pytest.mark.parametrize("cancelled", ["while queued", "before it came"])
def test_a_withdrawn_ticket_is_not_waited_for(cancelled: str) -> None:
    scheduler = created(Scheduler(tick_tokens=1024))  # ticket_wait is 30 s: a tick that waited would pick nothing
    answers: list[dict[str, Any]] = []
    late = Request(typed("optim_step", RUN, "late"), wire(answers), user_id="user", run_id=RUN,
                   ticket=2)
    if cancelled == "while queued":
        scheduler.submit(late)
        assert scheduler.find("someone-else", "late") is None and scheduler.find("user", "late") is late
        scheduler.withdraw(late, cancel_error(True, 0.25))
    else:
        scheduler.refuse_on_arrival("user", "late", True)
        scheduler.submit(late)
    (answer,) = answers
    assert answer["error"]["code"] == "DEADLINE_EXCEEDED" and answer["error"]["retryable"] is False
    assert scheduler.find("user", "late") is None and scheduler.withdrawn == {"user": 1}
    scheduler.submit(call(3))
    scheduler.submit(call(1))
    assert tick(scheduler) == [1] and tick(scheduler) == [3]


def test_calls_refused_at_submit_release_their_tickets(tmp_path: Any, tiny_model_dir: str) -> None:
    """Three writing calls refused for low disk (issue 34 #12): the run's next call goes at once, not after waiting
    ticket_wait for tickets that will never come."""
    import dataclasses

    from gpu_runtime.engine.engine import Engine
    from gpu_runtime.errors import ResourceExhausted

    engine = Engine(tmp_path / "data", device="cpu")
    engine.create_run(RUN, "user", tiny_model_dir, lora={"r": 4})
    roomy = engine.shared.options
    engine.shared.options = dataclasses.replace(roomy, min_free_disk_bytes=2**62)  # more than any disk has free
    for ticket in (1, 2, 3):
        with pytest.raises(ResourceExhausted):
            engine.call("optim_step", run_id=RUN, ticket=ticket)
    engine.shared.options = roomy
    engine.submit_message("optim_step", {"run_id": RUN, "ticket": 4}, lambda message: None)
    assert engine.scheduler.has_work()  # its turn now: tickets 1..3 were released when refused
