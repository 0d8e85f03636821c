"""The API's rules hold in the dashboard: CSRF on every state-changing route, ownership everywhere
(another user's things are 404 before any stream starts), sessions, single-use login links."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from starlette.routing import Route

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link, sign_in
from web.csrf import EXEMPT_PREFIXES

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]


def state_changing_routes(server: LiveServer) -> list[tuple[str, str]]:
    """(method, concrete path) for every POST and DELETE route of the dashboard, read from the router."""
    found = []
    for route in server.app.routes:
        # The API-key endpoints (/graphql, Tinker's /api/v1/, OpenAI's /v1/) are exempt: they never read the cookie.
        if not isinstance(route, Route) or route.path.startswith(EXEMPT_PREFIXES):
            continue
        params = {name: "1" if type(conv).__name__ == "IntegerConvertor" else "x" * 32
                  for name, conv in route.param_convertors.items()}
        for method in sorted((route.methods or set()) & {"POST", "DELETE", "PUT", "PATCH"}):
            found.append((method, route.path_format.format(**params)))
    return found


def test_the_router_has_state_changing_routes(live_server: LiveServer) -> None:
    routes = state_changing_routes(live_server)
    assert ("POST", "/keys") in routes and ("DELETE", "/runs/" + "x" * 32) in routes and len(routes) >= 8


def test_every_state_changing_route_refuses_without_the_csrf_token(live_server: LiveServer, visitor: Visitor) -> None:
    for method, path in state_changing_routes(live_server):
        missing = visitor.client.request(method, path, headers={"HX-Request": "true"})
        wrong = visitor.client.request(method, path, headers={"HX-Request": "true", "X-CSRF-Token": "forged"})
        assert (method, path, missing.status_code, wrong.status_code) == (method, path, 403, 403)


@dataclass
class Owned:
    run_id: str
    checkpoint_id: str
    key_id: str


@pytest.fixture(scope="module")
def owned(live_server: LiveServer) -> Owned:
    """A run with a checkpoint, and a key, all belonging to someone else."""
    secret = api_key_for(live_server, "owner@example.com")
    run = SignalClient(api_key=secret, base_url=live_server.url).create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    checkpoint = run.save_state()
    keys = live_server.graphql("{ apiKeys { id } }", key=secret)["data"]["apiKeys"]
    return Owned(run.id, str(checkpoint["id"]), keys[0]["id"])


PROBES = [
    ("GET", "/runs/{run}"),
    ("GET", "/runs/{run}/events"),
    ("GET", "/runs/{run}/checkpoints"),
    ("GET", "/runs/{run}/checkpoints/{checkpoint}/archive"),
    ("POST", "/runs/{run}/save"),
    ("DELETE", "/runs/{run}"),
    ("POST", "/playground"),
    ("DELETE", "/keys/{key}"),
]


@pytest.mark.parametrize(("method", "template"), PROBES)
def test_another_users_things_are_not_found(live_server: LiveServer, visitor: Visitor, owned: Owned,
                                            method: str, template: str) -> None:
    path = template.format(run=owned.run_id, checkpoint=owned.checkpoint_id, key=owned.key_id)
    headers = {"X-CSRF-Token": visitor.csrf}
    data = {"run_id": owned.run_id, "prompt": "hi"} if method == "POST" else None
    with visitor.client.stream(method, path, headers=headers, data=data) as response:
        assert response.status_code == 404
        assert not response.headers.get("content-type", "").startswith("text/event-stream")


def test_the_owner_still_has_everything_after_the_probes(live_server: LiveServer, owned: Owned) -> None:
    owner = sign_in(live_server, "owner@example.com")
    assert owner.client.get(f"/runs/{owned.run_id}").status_code == 200
    archive = owner.client.get(f"/runs/{owned.run_id}/checkpoints/{owned.checkpoint_id}/archive")
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/gzip"


def stream_events(response: httpx.Response, kind: str = "metrics") -> Iterator[tuple[str, list[dict]]]:
    """(event id, rows) of each `kind` event of an open event stream."""
    event, ident, data = "", "", ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("id:"):
            ident = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = line.split(":", 1)[1].strip()
        elif line == "" and event == kind:
            yield ident, json.loads(data)
            event = ""


def test_event_stream_resumes_after_last_event_id_without_duplicates(live_server: LiveServer) -> None:
    viewer = sign_in(live_server, "streamer@example.com")
    run = SignalClient(api_key=api_key_for(live_server, "streamer@example.com"), base_url=live_server.url).create_run(
        lora_r=4)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    with viewer.client.stream("GET", f"/runs/{run.id}/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        first_id, rows = next(stream_events(response))
    assert [row["name"] for row in rows] == ["loss:mean", "num_tokens", "num_examples", "throughput", "grad_norm",
                                             "learning_rate"]
    assert first_id == f"{rows[-1]['id']}:0:0"  # "<metric id>:<sample id>:<checkpoint id>": no sample nor checkpoint

    run.forward_backward(batch=BATCH)  # written while nobody listens
    with viewer.client.stream("GET", f"/runs/{run.id}/events", headers={"Last-Event-ID": first_id}) as response:
        second_id, rows = next(stream_events(response))
    assert [row["name"] for row in rows] == ["loss:mean", "num_tokens", "num_examples", "throughput"]
    assert min(row["id"] for row in rows) > int(first_id.split(":")[0]) and second_id == f"{rows[-1]['id']}:0:0"

    # Samples resume the same way: one made while nobody listens arrives once on the reconnect, alone.
    output = run.sample(prompts=["Resume"], max_tokens=2)["outputs"][0]
    with viewer.client.stream("GET", f"/runs/{run.id}/events", headers={"Last-Event-ID": second_id}) as response:
        third_id, samples = next(stream_events(response, "samples"))
    assert [(sample["prompt"], sample["output"]) for sample in samples] == [("Resume", output)]
    assert third_id == f"{second_id.split(':')[0]}:{samples[0]['id']}:0"

    # And checkpoints (the loss chart's markers): one saved while nobody listens arrives once on the reconnect.
    saved = run.save_state(name="resumed")
    with viewer.client.stream("GET", f"/runs/{run.id}/events", headers={"Last-Event-ID": third_id}) as response:
        fourth_id, checkpoints = next(stream_events(response, "checkpoints"))
    assert [(c["id"], c["name"], c["mode"], c["step"]) for c in checkpoints] == [(int(saved["id"]), "resumed",
                                                                                   "adapter", 1)]
    assert fourth_id == f"{third_id.rsplit(':', 1)[0]}:{saved['id']}"


def test_login_link_works_once(live_server: LiveServer) -> None:
    link = mint_login_link(live_server, "once@example.com")
    token = link.split("token=")[1]
    sign_in_twice = []
    for _ in range(2):
        with httpx.Client(base_url=live_server.url) as client:
            page = client.get(link)
            csrf = page.text.split('"X-CSRF-Token": "')[1].split('"')[0]
            sign_in_twice.append(client.post("/auth/link", data={"token": token},
                                             headers={"X-CSRF-Token": csrf}).status_code)
    assert sign_in_twice == [303, 401]


def test_logout_ends_the_session(live_server: LiveServer, visitor: Visitor) -> None:
    assert visitor.post("/logout").headers["hx-redirect"] == "/login"
    response = visitor.client.get("/keys")
    assert response.status_code == 303 and response.headers["location"].startswith("/login")


def test_session_cookie_is_httponly_and_lax(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.url) as client:
        cookie = client.get("/login").headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "secure" not in cookie  # plain http here


@pytest.mark.parametrize(("is_admin", "status"), [(True, 200), (False, 404)])
def test_admin_page_is_for_admins_only(live_server: LiveServer, is_admin: bool, status: int) -> None:
    viewer = sign_in(live_server, f"admin-{is_admin}@example.com", is_admin=is_admin)
    page = viewer.client.get("/admin")
    assert page.status_code == status
    if is_admin:  # tables, not the runtime's raw answer (tests/web/test_admin.py checks what they say)
        assert 'id="admin-users"' in page.text and 'id="admin-runs"' in page.text and "resident_runs" not in page.text


def test_graphiql_page_loads_nothing_from_a_cdn(live_server: LiveServer) -> None:
    html = httpx.get(f"{live_server.url}/graphql", headers={"Accept": "text/html"}).text
    assert "/static/vendor/graphiql-3.9.0/graphiql.min.js" in html
    assert "unpkg" not in html and "jsdelivr" not in html and "https://" not in html


@pytest.mark.parametrize(("public_url", "secure"), [("https://signal.example.com", True), ("", False)])
def test_session_cookie_is_secure_behind_https(tmp_path, public_url: str, secure: bool) -> None:  # type: ignore[no-untyped-def]
    from app.settings import Settings
    from web.session import session_middleware

    settings = Settings(_env_file=None, data_dir=tmp_path, public_url=public_url)
    assert session_middleware(settings).kwargs["https_only"] is secure


def test_generated_session_secret_is_private_and_stable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from app.settings import Settings
    from web.session import session_secret

    settings = Settings(_env_file=None, data_dir=tmp_path)
    assert session_secret(settings) == session_secret(settings)
    assert (tmp_path / "session_secret").stat().st_mode & 0o777 == 0o600
