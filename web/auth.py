"""Sign-in and out: one-time login links (the offline default) and Google through Supabase Auth."""

from __future__ import annotations

from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from app.errors import Unauthenticated
from app.services.next_path import safe_next_path
from web.render import hx_redirect, is_htmx, page, services
from web.session import current, sign_in, sign_out

PENDING_LOGINS = 5  # Google sign-ins one browser may have in flight (several tabs)
NEXT = "next"  # the cookie's key for where to go after signing in (kept before sign-in, in the signed cookie)
USED_LINK = "This sign-in link has been used, has expired or is unknown. Each link works once, for a few minutes."


def _remember_next(request: Request) -> str:
    """Where this browser goes after signing in: ?next= (a local path only), kept in the cookie until then, so
    a one-time link opened later in this browser lands there too."""
    if NEXT in request.query_params:
        request.session[NEXT] = safe_next_path(request.query_params[NEXT])
    return safe_next_path(request.session.get(NEXT))


async def login(request: Request) -> Response:
    next_path = _remember_next(request)
    if await current(request) is not None:
        return RedirectResponse(next_path, status_code=303)  # already signed in: straight on
    return page(request, "login.html", next=next_path)


async def link_page(request: Request) -> Response:
    # Consuming on GET would let a link previewer (chat unfurls, mail scanners) burn the link:
    # the page posts it from the browser instead. Checking it reads only, so a used link says so at once.
    token = request.query_params.get("token", "")
    next_path = _remember_next(request)
    if not await services(request).login_links.usable(token):
        return page(request, "login_link.html", status_code=401, error=USED_LINK, next=next_path)
    return page(request, "login_link.html", token=token)


async def link_consume(request: Request) -> Response:
    form = await request.form()
    token = str(form.get("token", ""))
    try:
        user = await services(request).login_links.consume(token)
    except Unauthenticated:
        # Used in another tab since the page loaded: the page itself shows the lasting error, not a toast.
        if is_htmx(request):
            return Response(status_code=204, headers={"HX-Redirect": "/auth/link?" + urlencode({"token": token})})
        return page(request, "login_link.html", status_code=401, error=USED_LINK,
                    next=safe_next_path(request.session.get(NEXT)))
    next_path = safe_next_path(request.session.get(NEXT))
    await sign_in(request, user)
    return hx_redirect(request, next_path)


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
    await sign_in(request, signed.user)
    request.session["login_states"] = remaining  # another tab's sign-in may still be on its way back
    return RedirectResponse(signed.next_path, status_code=303)


async def logout(request: Request) -> Response:
    await sign_out(request)
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
