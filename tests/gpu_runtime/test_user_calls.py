"""A user's calls in flight are bounded in the scheduler: past the bound they wait their turn, past the waiting
lane's length they are refused RESOURCE_EXHAUSTED (resource calls) with a retry_after_s. The scheduler alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_runtime.client.protocol import answer_message
from gpu_runtime.contract import CancelResult, CreateRun, OptimStep, Ping
from gpu_runtime.engine.request import SYSTEM, Answer, Request
from gpu_runtime.engine.scheduler import RETRY_AFTER_S, Scheduler

DONE = CancelResult(found=True)  # any result: the scheduler reads only that it is not an error


def wire(answers: list[dict[str, Any]]) -> Callable[[Answer], None]:
    """Keep each answer as the wire carries it."""
    return lambda answer: answers.append(answer_message(answer))


def call(user: str, run_id: str, answers: list[dict[str, Any]] | None = None) -> Request:
    return Request(OptimStep(run_id=run_id), wire(answers if answers is not None else []), user_id=user,
                   run_id=run_id)


def heads(scheduler: Scheduler) -> list[str | None]:
    return [request.run_id for request in scheduler.heads()]


def test_past_the_bound_calls_wait_then_are_refused() -> None:
    scheduler = Scheduler(tick_tokens=1024, user_calls=2, user_queue=1)
    answers: list[dict[str, Any]] = []
    first, second, third, fourth = (call("flood", f"r{n}", answers) for n in range(4))
    for request in (first, second, third, fourth):
        scheduler.submit(request)
    assert heads(scheduler) == ["r0", "r1"]  # r2 waits in the user's lane
    (refused,) = answers  # r3: nowhere left to wait
    error = refused["error"]
    assert error["code"] == "RESOURCE_EXHAUSTED" and error["retryable"] is True
    assert error["details"]["resource"] == "calls"
    assert RETRY_AFTER_S[0] <= error["details"]["retry_after_s"] <= RETRY_AFTER_S[1]
    assert scheduler.queue_depth_by_user() == {"flood": 3} and scheduler.pending() == 3

    scheduler.finish(first, DONE)  # an answer frees a place: the waiting call is taken in
    assert heads(scheduler) == ["r1", "r2"]
    scheduler.submit(call("flood", "r4", answers))  # and the lane has room again
    assert len(answers) == 2 and scheduler.pending() == 3


def test_another_users_calls_and_system_calls_are_not_held_by_a_flood() -> None:
    scheduler = Scheduler(tick_tokens=1024, user_calls=1, user_queue=0)
    answers: list[dict[str, Any]] = []
    scheduler.submit(call("flood", "r0", answers))
    scheduler.submit(call("flood", "r1", answers))
    scheduler.submit(call("other", "r2", answers))
    scheduler.submit(Request(Ping(), wire(answers)))  # the system lane: never counted
    assert [a["error"]["details"]["resource"] for a in answers] == ["calls"]  # r1 only
    plan = scheduler.next_tick(lambda request: 0)
    assert sorted(p.request.run_id or "" for p in plan.picks) == ["r0", "r2"]
    assert [r.user_id for r in plan.system] == [SYSTEM]


def test_without_a_bound_nothing_is_held() -> None:
    scheduler = Scheduler(tick_tokens=1024)
    for n in range(50):
        scheduler.submit(call("flood", f"r{n}"))
    assert len(heads(scheduler)) == 50


def test_a_ticket_that_calls_taken_in_wait_for_goes_past_the_bound() -> None:
    scheduler = Scheduler(tick_tokens=1024, user_calls=1, user_queue=0)
    created = Request(CreateRun(run_id="r0", user_id="u", base_model="base"), lambda answer: None, user_id="u",
                      run_id="r0")
    scheduler.submit(created)
    scheduler.finish(created, DONE)  # r0's tickets start at 1
    answers: list[dict[str, Any]] = []
    held = Request(OptimStep(run_id="r0"), wire(answers), user_id="u", run_id="r0", ticket=2)
    scheduler.submit(held)  # taken in (the user's one place), it waits for ticket 1
    assert scheduler.heads() == []
    scheduler.submit(call("u", "r1", answers))  # refused: no place, no lane
    assert [a["error"]["code"] for a in answers] == ["RESOURCE_EXHAUSTED"]
    due = Request(OptimStep(run_id="r0"), wire(answers), user_id="u", run_id="r0", ticket=1)
    scheduler.submit(due)  # past the bound: the call taken in waits for it
    assert scheduler.heads() == [due] and len(answers) == 1
