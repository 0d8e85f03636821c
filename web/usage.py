"""The Usage page (issue 18 §6): compute seconds, GPU-seconds, cost and tokens trained and sampled, over the last days
(by day), per run, and for an admin per user, from the call records (app/services/usage.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadInput, Forbidden, NotFound
from app.services.usage import DEFAULT_DAYS
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

WINDOWS = (7, 30, 90, 365)  # the page's choices of days


@signed_in
async def usage_page(request: Request, user: User) -> Response:
    usage = services(request).usage
    raw_days = request.query_params.get("days", str(DEFAULT_DAYS))
    if not raw_days.isdigit():
        raise BadInput("days must be a whole number of days", field="days")
    days = int(raw_days)
    try:
        report = await usage.report(user, request.query_params.get("user") or None, days,
                                    request.query_params.get("run") or None)
    except Forbidden:
        raise NotFound("page not found") from None  # another user's usage: not for everyone to learn it exists
    users = await usage.by_user(user, days) if user.is_admin else None
    # The chart's points, oldest day first: [day, compute seconds, credits].
    chart = [[line.key, round(line.compute_seconds, 3), round(line.credits, 4)] for line in reversed(report.by_day)]
    return page(request, "usage.html", user=user, report=report, users=users, windows=WINDOWS, chart=chart,
                until=report.since + timedelta(days=report.days - 1),  # today (UTC): the window's last day
                rates=services(request).runs.ledger.rates)


routes = [Route("/usage", usage_page)]
