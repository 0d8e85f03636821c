"""The runtime's queue: per-run FIFO order, fair turns across users, and each tick's share of work.

- **Per-run order.** Each run has a FIFO queue and only its head is ever eligible, so calls on
  one run apply in arrival order whatever the server does. A head stays put until it is done:
  a forward_backward split across ticks, or a sample decoding over many ticks, holds its run.
- **Tickets: one order across server processes** (gpu_runtime/engine/tickets.py keeps their books). A server numbers
  each call on a run from the database (`runs.call_seq`); a ticketed call queues in ticket order and waits until
  the run's earlier tickets are done, at most `ticket_wait` seconds (its server may have died between
  ticket and call), then goes on, logged. A runtime that has not seen the run since it started
  takes the first ticket it gets as the start; a ticket behind the run's goes when it arrives.
- **Fairness: least recently served first.** A tick visits users in the order of the tick that
  last served them (never served: first; ties: whoever has waited longest), and takes one head
  per user per round until the tick's token budget is spent. A user who floods the queue gets
  one turn per round like everyone else, so another user's single call lands in the next tick
  or the one after; the flooder is served every tick the others leave room in, so never starved.
- **Frozen samples: no run's order.** A sample on a snapshot or a base (`Request.frozen`) waits in a lane of its
  own: every one is handed to the next tick (`TickPlan.free`), so all pending ones join one decode group, and none
  holds or waits for its run's queue. One whose snapshot is still being made is `park`ed until a run's call
  finishes (the save it waits for is one).
- **A user's calls in flight are bounded** (`user_calls`), here where every server process's calls meet. Past the
  bound a user's calls wait in a lane of their own, in arrival order, taken in as the user's earlier calls are
  answered; past `user_queue` waiting, a call is refused at once with RESOURCE_EXHAUSTED (resource "calls") and a
  `retry_after_s` from how long the user's calls have been taking. Calls on no run (ping) are never counted, and a
  ticket that calls taken in on its run wait for goes in past the bound (else they would wait out `ticket_wait`).
- **Withdrawn calls: never applied, their tickets skipped.** A `cancel` (a deadline, or a client gone) takes a call
  not yet begun off whichever lane holds it and answers it CANCELLED or DEADLINE_EXCEEDED (`withdraw`); its ticket is
  counted done, so the run's next ticket does not wait `ticket_wait` for it. A cancel for a call not here yet is
  remembered (`refuse_on_arrival`): the call is answered so as it arrives, and its ticket skipped.
- **A tick's budget** bounds forward_backward rows in tokens. While heads are chosen each is
  charged at most a fair share (budget / users), so a big call does not shut out small ones;
  then the budget is water-filled: small calls go whole, big ones split what is left and
  continue next tick. Calls that cost no tokens (optim_step, save_state, starting a sample)
  ride along. A run's next call may follow its head in the same tick (`next_calls`: an optim_step
  right behind a forward_backward the tick's pass completed), in its ticket's turn.

No torch here, and no engine state: the engine prices the heads before the tick (`cost` is a plain lookup:
tokens, 0, or None for a head not ready this tick) and nothing is answered from inside the planner.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.contract import CreateRun
from gpu_runtime.engine.request import _DONE, SYSTEM, Answer, Request
from gpu_runtime.engine.tickets import TICKET_WAIT_SECONDS, Tickets
from gpu_runtime.errors import Cancelled, DeadlineExceeded, ResourceExhausted, SignalError

log = logging.getLogger("gpu_runtime.engine.scheduler")

MIN_SHARE_TOKENS = 64  # a tick takes at most tick_tokens / 64 forward_backward heads
RETRY_AFTER_S = (1.0, 30.0)  # a refused call is told to come back after its user's typical call time, within these
REMEMBERED_CANCELS = 1024  # cancels of calls not here yet, kept for their arrival (oldest forgotten first)


def cancel_error(deadline: bool, compute_seconds: float = 0.0) -> SignalError:
    """A withdrawn call's answer: it was never applied. `compute_seconds`: what it had used (the server logs them)."""
    seconds = round(compute_seconds, 6)
    if deadline:
        return DeadlineExceeded("the call's deadline passed before it was applied: it never was", compute_seconds=seconds)
    return Cancelled("the call was cancelled before it was applied (its client went away)", compute_seconds=seconds)


@dataclass
class Pick:
    request: Request
    allowance: int  # tokens this tick may spend on it (forward_backward only)


@dataclass
class TickPlan:
    number: int
    system: list[Request] = field(default_factory=list)
    picks: list[Pick] = field(default_factory=list)
    free: list[Request] = field(default_factory=list)  # frozen samples, every one pending (taken off the lane)


class Scheduler:
    def __init__(self, tick_tokens: int, ticket_wait: float = TICKET_WAIT_SECONDS, user_calls: int | None = None,
                 user_queue: int = 0) -> None:
        self.tick_tokens = tick_tokens
        self.tickets = Tickets(ticket_wait)  # whose turn it is on each run, across server processes
        self.user_calls = user_calls  # a user's calls in flight at most (None: unbounded)…
        self.user_queue = user_queue  # …and past it, at most this many waiting; more are refused
        self._in_flight: dict[str, int] = {}  # user → calls taken in and not yet answered
        self._waiting: dict[str, deque[Request]] = {}  # user → calls past the bound, oldest first
        self._call_seconds: dict[str, float] = {}  # user → a moving average of their calls' time in flight
        self.refused: dict[str, int] = {}  # user → calls refused past the bound since start (runtime_state shows it)
        self._cancels: OrderedDict[tuple[str, str], bool] = OrderedDict()  # (user, request id) → deadline, not here yet
        self.withdrawn: dict[str, int] = {}  # user → calls withdrawn by a cancel since start (runtime_state shows it)
        self.condition = threading.Condition()
        self._runs: dict[str, deque[Request]] = {}
        self._system: deque[Request] = deque()
        self._free: list[Request] = []  # frozen samples not yet started
        self._parked: list[Request] = []  # frozen samples waiting for the call that makes their snapshot
        self._busy: set[str] = set()  # runs whose head is in progress outside the tick loop's picks (decoding)
        self._last_served: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._ticks = itertools.count(1)
        self.closed = False

    # ---- producers (any thread) ----------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue `request`; or hold it past its user's bound; or, past the waiting lane's length, refuse it now; or,
        cancelled before it came, answer it so now."""
        with self.condition:
            request.arrival = next(self._arrivals)
            refusal = self._cancelled_before(request) or self._admit(request)
            if refusal is None:
                return
        request.reply, reply = _DONE, request.reply
        reply(refusal)

    def _cancelled_before(self, request: Request) -> SignalError | None:
        key = request.request_id or (request.run_id if isinstance(request.call, CreateRun) else None)
        deadline = self._cancels.pop((request.user_id, key), None) if key else None
        if deadline is None:
            return None
        self.tickets.skip(request)
        self.withdrawn[request.user_id] = self.withdrawn.get(request.user_id, 0) + 1
        return cancel_error(deadline)

    def _admit(self, request: Request) -> SignalError | None:
        """Take `request` in, or hold it in its user's waiting lane (None); past that lane's length, its refusal."""
        bounded = self.user_calls is not None and request.user_id != SYSTEM
        full = bounded and self._in_flight.get(request.user_id, 0) >= (self.user_calls or 0)
        if full and not self._unblocks(request):
            waiting = self._waiting.setdefault(request.user_id, deque())
            if len(waiting) < self.user_queue:
                waiting.append(request)
                return None
            self.refused[request.user_id] = self.refused.get(request.user_id, 0) + 1
            self.tickets.skip(request)  # never applied: the run's later tickets do not wait ticket_wait for it
            self.condition.notify_all()  # a call held for the refused ticket may go now
            return self._refusal(request.user_id, len(waiting))
        self._take(request, bounded)
        self.condition.notify_all()
        return None

    def _unblocks(self, request: Request) -> bool:
        """A ticket that calls already taken in on its run wait for: it goes past the bound, or they would hold their
        user's places until their ticket wait ran out with nothing able to free them."""
        return request.ticket is not None and any((queued.ticket or 0) > request.ticket
                                                  for queued in self._runs.get(request.run_id or "", ()))

    def _take(self, request: Request, counted: bool) -> None:
        request.since = time.monotonic()
        if counted:
            request.counted = True
            self._in_flight[request.user_id] = self._in_flight.get(request.user_id, 0) + 1
        if request.frozen:
            self._free.append(request)
            request.runnable_since = request.since
        elif request.run_id is None:
            self._system.append(request)
            request.runnable_since = request.since
        else:
            self._place(self._runs.setdefault(request.run_id, deque()), request)
            self._runnable(request.run_id)

    def _release(self, request: Request) -> None:
        """A counted call was answered: its user's next waiting call, if any, is taken in."""
        user = request.user_id
        seconds = time.monotonic() - request.since
        self._call_seconds[user] = 0.8 * self._call_seconds.get(user, seconds) + 0.2 * seconds
        self._in_flight[user] -= 1
        waiting = self._waiting.get(user)
        if waiting:
            self._take(waiting.popleft(), True)
        if not waiting:
            self._waiting.pop(user, None)
        if not self._in_flight[user]:
            del self._in_flight[user]

    def _refusal(self, user: str, waiting: int) -> ResourceExhausted:
        low, high = RETRY_AFTER_S
        retry_after = round(min(max(self._call_seconds.get(user, low), low), high), 1)
        return ResourceExhausted(f"too many calls in flight: {self.user_calls} running and {waiting} waiting is "
                                 f"the most one user may have; retry after {retry_after} s",
                                 resource="calls", retry_after_s=retry_after)

    def _place(self, queue: deque[Request], request: Request) -> None:
        """Ticketed calls queue in ticket order, ahead of later tickets not yet started; others at the back."""
        position = len(queue)
        if request.ticket is not None:
            started = bool(queue) and (queue[0].started or request.run_id in self._busy)
            while position > int(started) and (queue[position - 1].ticket or 0) > request.ticket:
                position -= 1
        queue.insert(position, request)

    def _ready(self, run_id: str, queue: deque[Request], now: float) -> bool:
        """Whether the run's head may go: there is one, no decode group holds the run, and it is its ticket's turn."""
        return bool(queue) and run_id not in self._busy and self.tickets.turn(queue[0], now)

    def _next_turn_in(self, now: float) -> float | None:
        """Seconds until the first held head's wait runs out (None: none is held)."""
        waits = [q[0].since + self.tickets.wait - now for run, q in self._runs.items()
                 if q and run not in self._busy and not self.tickets.turn(q[0], now)]
        return max(min(waits), 0.0) if waits else None

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()

    def wait_for_work(self, timeout: float | None, also_busy: bool = False) -> bool:
        """Block until something can be picked (or `also_busy`: some work is in flight); False on timeout/close."""
        with self.condition:
            now = time.monotonic()
            for held in (self._next_turn_in(now), self._next_deadline_in(now)):
                if held is not None:  # a held call's wait ends, or a deferred deadline: work then
                    timeout = held if timeout is None else min(timeout, held)
            return self.condition.wait_for(lambda: self.has_work() or also_busy or self.closed, timeout)

    # ---- the consumer (the engine's thread) ----------------------------------------------

    def has_work(self) -> bool:
        with self.condition:
            now = time.monotonic()
            return bool(self._system) or bool(self._free) or any(self._ready(run, q, now) for run, q in self._runs.items())

    def pending(self) -> int:
        with self.condition:
            return (len(self._system) + len(self._free) + len(self._parked) + sum(len(q) for q in self._runs.values())
                    + sum(len(w) for w in self._waiting.values()))

    def queue_depth_by_user(self) -> dict[str, int]:
        with self.condition:
            depth: dict[str, int] = {}
            for queue in [*self._runs.values(), *self._waiting.values()]:
                for request in queue:
                    depth[request.user_id] = depth.get(request.user_id, 0) + 1
            return depth

    def heads(self) -> list[Request]:
        """The heads that may go this tick, oldest first (the engine prices these before `next_tick`)."""
        with self.condition:
            now = time.monotonic()
            heads = [q[0] for run, q in self._runs.items() if self._ready(run, q, now)]
            return sorted(heads, key=lambda r: r.arrival)

    def next_tick(self, cost: Callable[[Request], int | None]) -> TickPlan:
        """Choose this tick's work. `cost` gives a head's remaining forward_backward tokens (0 for other calls;
        None: not ready this tick, it keeps its place)."""
        with self.condition:
            plan = TickPlan(next(self._ticks), system=list(self._system), free=self._free)
            self._system.clear()
            self._free = []
            heads: dict[str, list[str]] = {}  # user → runs with an eligible head, oldest head first
            now = time.monotonic()
            for run_id, queue in sorted(self._runs.items(), key=lambda item: item[1][0].arrival if item[1] else 0):
                if self._ready(run_id, queue, now):
                    heads.setdefault(queue[0].user_id, []).append(run_id)
        # Least recently served users first; among equals, whoever's head has waited longest.
        users = sorted(heads, key=lambda u: (self._last_served.get(u, -1), self._runs[heads[u][0]][0].arrival))
        # Choosing heads charges each at most a fair share of the budget, so one big call cannot
        # crowd out the small calls of users behind it; the shares are then settled by water-filling.
        budget = self.tick_tokens
        charge_cap = max(self.tick_tokens // max(len(users), 1), 1)
        most_fb_picks = max(2, self.tick_tokens // MIN_SHARE_TOKENS)  # every pick takes a row at least
        wanted: list[tuple[Pick, int]] = []  # forward_backward picks and the tokens each still needs
        while any(heads[u] for u in users):
            for user in users:
                while heads[user]:
                    run_id = heads[user].pop(0)
                    request = self._runs[run_id][0]
                    tokens = cost(request)
                    if tokens is None:
                        continue
                    if tokens > 0 and (budget <= 0 or len(wanted) >= most_fb_picks):
                        continue  # no room for rows this tick; it keeps its place in line
                    pick = Pick(request, 0)
                    plan.picks.append(pick)
                    if tokens > 0:
                        wanted.append((pick, tokens))
                        budget -= min(tokens, charge_cap)
                    self._last_served[user] = plan.number
                    break
        _water_fill(wanted, self.tick_tokens)
        return plan

    def next_calls(self, heads: list[Request], joins: Callable[[Request], bool]) -> list[Request]:
        """For each head done in this tick's passes (answered once the tick's journals are synced), its run's next
        call if `joins` takes it and its ticket's turn comes once the head is done: it runs in this tick too. Left
        in place: answered after its head, it is then the head `finish` takes off."""
        with self.condition:
            now = time.monotonic()
            taken = []
            for head in heads:
                queue = self._runs.get(head.run_id or "")
                if not queue or queue[0] is not head or len(queue) < 2 or head.run_id in self._busy:
                    continue
                after = queue[1]
                if joins(after) and self.tickets.turn_after(head, after, now):
                    after.runnable_since = after.runnable_since or now
                    taken.append(after)
            return taken

    def finish(self, request: Request, answer: Answer) -> None:
        """Answer a head and take it off its run's queue (the next call on the run becomes eligible)."""
        reply, request.reply = request.reply, _DONE
        with self.condition:
            self.tickets.done(request, created=isinstance(request.call, CreateRun) and not isinstance(answer, SignalError))
            if request.run_id is not None:
                queue = self._runs.get(request.run_id)
                if queue and queue[0] is request:
                    queue.popleft()
                if not queue:
                    self._runs.pop(request.run_id, None)
                self._busy.discard(request.run_id)
                self._runnable(request.run_id)
                self._free += self._parked  # the call a parked sample waits for may be this one: look again
                self._parked = []
            if request.counted:  # after it left its run's queue, so a call taken in now queues behind no ghost
                request.counted = False
                self._release(request)
            self.condition.notify_all()
        reply(answer)

    def find(self, user_id: str, request_id: str) -> Request | None:
        """The user's call `request_id` wherever it waits here (queued, parked, past the bound), else None."""
        with self.condition:
            lanes = [self._system, self._free, self._parked, *self._runs.values(), *self._waiting.values()]
            return next((r for lane in lanes for r in lane if r.user_id == user_id and r.named(request_id)), None)

    def refuse_on_arrival(self, user_id: str, request_id: str, deadline: bool) -> None:
        """A cancel for a call not here (yet): if it comes, it is answered CANCELLED or DEADLINE_EXCEEDED at submit."""
        with self.condition:
            self._cancels[(user_id, request_id)] = deadline
            while len(self._cancels) > REMEMBERED_CANCELS:
                self._cancels.popitem(last=False)

    def withdraw(self, request: Request, error: SignalError) -> None:
        """Take a call not yet applied off whichever lane holds it, count its ticket done, and answer `error`."""
        reply, request.reply = request.reply, _DONE
        with self.condition:
            for lane in [self._system, self._free, self._parked, *self._runs.values(), *self._waiting.values()]:
                if request in lane:
                    lane.remove(request)
            for lanes in (self._runs, self._waiting):
                for key in [key for key, queue in lanes.items() if not queue]:
                    del lanes[key]
            if request.run_id is not None:
                self._runnable(request.run_id)
            self.tickets.skip(request)
            self.withdrawn[request.user_id] = self.withdrawn.get(request.user_id, 0) + 1
            if request.counted:
                request.counted = False
                self._release(request)
            self.condition.notify_all()
        log.info("withdrew %s %s of user %s (ticket %s): %s", request.method, request.request_id, request.user_id,
                 request.ticket, error.code)
        reply(error)

    def release_ticket(self, run_id: object, ticket: object) -> None:
        """A call refused before it was queued (a bad argument, a full disk): its ticket counts as done, so the run's
        later calls do not wait ticket_wait for a call that will never come. Takes what the refused call carried,
        checked here: a call refused while it was parsed has no typed form."""
        if isinstance(run_id, str) and type(ticket) is int and ticket >= 1:
            with self.condition:
                self.tickets.skip_ticket(run_id, ticket)
                self.condition.notify_all()

    def _runnable(self, run_id: str) -> None:
        """The run's head can run from now, if it could not before: its deadline counts from here (deadlines.py)."""
        queue = self._runs.get(run_id)
        if queue and run_id not in self._busy and queue[0].runnable_since is None:
            queue[0].runnable_since = time.monotonic()

    def past_deadline(self) -> list[Request]:
        """Calls whose deferred deadline (Cancel.deadline_s) has run out since they could run, not yet begun."""
        with self.condition:
            now = time.monotonic()
            return [r for r, due in self._deadlines(now) if due <= 0]

    def _deadlines(self, now: float) -> list[tuple[Request, float]]:
        """Each unbegun call with a deferred deadline, and the seconds until it runs out (past_deadline's and
        wait_for_work's one rule: a call it would not withdraw must not wake the engine, which would then spin)."""
        lanes = [self._free, *(queue for run, queue in self._runs.items() if run not in self._busy)]
        return [(r, r.runnable_since + r.deadline_s - now) for lane in lanes for r in lane
                if r.deadline_s is not None and not r.started and r.runnable_since is not None]

    def _next_deadline_in(self, now: float) -> float | None:
        due = [seconds for _, seconds in self._deadlines(now)]
        return max(min(due), 0.0) if due else None

    def hold(self, run_id: str) -> None:
        """The run's head is in progress outside the picks (a decode group): not eligible until finished."""
        with self.condition:
            self._busy.add(run_id)

    def park(self, request: Request) -> None:
        """A frozen sample whose source a queued call still has to make: back in the lane once a run's call is done."""
        with self.condition:
            self._parked.append(request)

    def queued_on(self, run_id: str) -> list[Request]:
        """The run's queued calls, head first (left in place)."""
        with self.condition:
            return list(self._runs.get(run_id, ()))

    def is_queued(self, run_id: str) -> bool:
        with self.condition:
            return bool(self._runs.get(run_id)) or run_id in self._busy

    def queued(self) -> list[Request]:
        """Every request still queued, oldest first (left in place)."""
        with self.condition:
            return sorted([r for q in self._runs.values() for r in q], key=lambda r: r.arrival)

    def drain(self) -> list[Request]:
        """Everything still queued (at shutdown), oldest first."""
        with self.condition:
            requests = list(self._system) + self._free + self._parked + [r for q in self._runs.values() for r in q]
            requests += [r for w in self._waiting.values() for r in w]
            self._system.clear()
            self._free, self._parked = [], []
            self._runs.clear()
            self._waiting.clear()
            return sorted(requests, key=lambda r: r.arrival)


def _water_fill(wanted: list[tuple[Pick, int]], budget: int) -> None:
    """Share `budget` among picks: the smallest needs are met whole, the rest split what remains evenly."""
    left = len(wanted)
    for pick, tokens in sorted(wanted, key=lambda item: item[1]):
        pick.allowance = max(min(tokens, budget // left), 1)  # at least one row: every pick makes progress
        budget -= pick.allowance
        left -= 1
