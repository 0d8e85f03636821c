"""Sign-in and out: one-time login links (the offline default) and Google through Supabase Auth."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from app.errors import Unauthenticated
from web.render import hx_redirect, page, services
from web.session import sign_in, sign_out

PENDING_LOGINS = 5  # Google sign-ins one browser may have in flight (several tabs)


async def login(request: Request) -> Response:
    return page(request, "login.html", next=request.query_params.get("next", "/"))


async def link_page(request: Request) -> Response:
    # Consuming on GET would let a link previewer (chat unfurls, mail scanners) burn the link:
    # the page posts it from the browser instead.
    return page(request, "login_link.html", token=request.query_params.get("token", ""))


async def link_consume(request: Request) -> Response:
    form = await request.form()
    try:
        user = await services(request).login_links.consume(str(form.get("token", "")))
    except Unauthenticated as error:
        return Response(error.message, status_code=401, media_type="text/plain")
    sign_in(request, user)
    return hx_redirect(request, "/runs")


async def google_start(request: Request) -> Response:
    supabase = services(request).supabase
    if supabase is None:
        return Response("Google sign-in is not configured on this server.", status_code=404)
    form = await request.form()
    url, state = await supabase.start(_callback_url(request), str(form.get("next", "/")))
    # The state is bound to this browser too: a callback carrying someone else's state is refused,
    # so nobody can sign a victim into the attacker's account.
    request.session["login_states"] = [*request.session.get("login_states", []), state][-PENDING_LOGINS:]
    return hx_redirect(request, url)


async def google_callback(request: Request) -> Response:
    supabase = services(request).supabase
    if supabase is None:
        return Response("Google sign-in is not configured on this server.", status_code=404)
    state = request.query_params.get("state", "")
    pending = list(request.session.get("login_states", []))
    try:
        if state not in pending:
            raise Unauthenticated("this sign-in was not started in this browser; start again")
        remaining = [s for s in pending if s != state]
        request.session["login_states"] = remaining
        signed = await supabase.finish(state, request.query_params.get("code", ""), _callback_url(request))
    except Unauthenticated as error:
        return page(request, "login.html", status_code=401, error=error.message, next="/")
    sign_in(request, signed.user)
    request.session["login_states"] = remaining  # another tab's sign-in may still be on its way back
    return RedirectResponse(signed.next_path, status_code=303)


async def logout(request: Request) -> Response:
    sign_out(request)
    return hx_redirect(request, "/login")


def _callback_url(request: Request) -> str:
    return f"{services(request).settings.resolved_public_url}/auth/callback"


routes = [
    Route("/login", login),
    Route("/auth/link", link_page, methods=["GET"]),
    Route("/auth/link", link_consume, methods=["POST"]),
    Route("/auth/google", google_start, methods=["POST"]),
    Route("/auth/callback", google_callback),
    Route("/logout", logout, methods=["POST"]),
]
