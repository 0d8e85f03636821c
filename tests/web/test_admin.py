"""The admin page (issue 18 §7) against a real server, its runtime and Chromium: users with their run and key counts,
live keys across users (revoking one stops it at once), runs across users with where the runtime holds each, and the
runtime's bases, queue and recent ticks. Anyone else gets a 404 on every admin path. Disabling a user from this page
is tested with the other ways a session ends (tests/web/test_sessions.py)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser
from sqlalchemy import update

from app.db import Database
from app.tables import Run
from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for
from tests.web.conftest import Visitor, api_key_for, mint_login_link, run_async, sign_in

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
RESIDENCY = {"resident": "in memory", "evicted": "evicted to disk", "": "not loaded"}
THREADS = (os.cpu_count() or 1) + 1  # not the default (the cores), so the runtime's report shows the setting took


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The conftest's server, its runtime started with SIGNAL_THREADS."""
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("admin-data"), tiny_model_dir, threads=THREADS))
    yield server
    server.stop()


def row(html: str, attribute: str, value: str) -> str:
    """The inside of the table row `<tr data-attribute="value">`."""
    found = re.search(rf'<tr data-{attribute}="{re.escape(value)}">(.*?)</tr>', html, re.S)
    assert found, f"no row with data-{attribute}={value!r}"
    return found.group(1)


def cell(row_html: str, name: str) -> str:
    found = re.search(rf'data-cell="{name}">(.*?)</td>', row_html, re.S)
    assert found, f"no {name} cell"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def ticks_on(html: str) -> list[tuple[int, int, int]]:
    """(tick, rows, passes) of the page's tick table, oldest first."""
    rows = re.findall(r'<tr data-tick="(\d+)"><td class="num">\d+</td><td class="num">(\d+)</td>'
                      r'<td class="num">(\d+)</td>', html)
    return sorted((int(n), int(r), int(p)) for n, r, p in rows)


def runtime_state(server: LiveServer) -> dict[str, Any]:
    return server.backend.client.submit("runtime_state").result(timeout=120)  # type: ignore[no-any-return]


def change_run(server: LiveServer, run_id: str, **values: Any) -> None:
    """Write the run's row as another server process would (a ticket taken, an activity long ago)."""
    async def write() -> None:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                await session.execute(update(Run).where(Run.id == run_id).values(**values))
        finally:
            await db.dispose()

    run_async(write())


@pytest.fixture(scope="module")
def admin(live_server: LiveServer) -> Visitor:
    return sign_in(live_server, "chief@example.com", is_admin=True)


def test_users_and_runs_tables_count_each_users_things_and_say_where_each_run_is(live_server: LiveServer,
                                                                                admin: Visitor) -> None:
    alice = SignalClient(api_key=api_key_for(live_server, "alice@example.com"), base_url=live_server.url)
    api_key_for(live_server, "alice@example.com")  # her second key
    bob = SignalClient(api_key=api_key_for(live_server, "bob@example.com"), base_url=live_server.url)
    trained, idle = alice.create_run(lora_r=4, name="alice trains"), alice.create_run(lora_r=4)
    trained.forward_backward(batch=BATCH)
    trained.optim_step(learning_rate=0.01)
    theirs = bob.create_run(lora_r=4, name="bob's run")
    idle.archive()
    change_run(live_server, theirs.id, updated_at=datetime.now(UTC) - timedelta(hours=2))

    page = admin.client.get("/admin")
    assert page.status_code == 200
    html = page.text
    state = runtime_state(live_server)  # a system call: it adds no tick, so the page's ticks are still all of them
    counts = {email: (cell(row(html, "user", email), "runs"), cell(row(html, "user", email), "keys"))
              for email in ("alice@example.com", "bob@example.com", "chief@example.com")}
    assert counts == {"alice@example.com": ("2", "2"), "bob@example.com": ("1", "1"), "chief@example.com": ("0", "0")}

    resident = {r["run_id"] for r in state["resident_runs"]}
    for run, owner in ((trained, "alice@example.com"), (idle, "alice@example.com"), (theirs, "bob@example.com")):
        line = row(html, "run", run.id)
        assert f"<td>{owner}</td>" in line
        held = "resident" if run.id in resident else "evicted" if run.id in state["evicted_runs"] else ""
        assert cell(line, "residency") == RESIDENCY[held]
        assert f'href="/runs/{run.id}"' not in line  # another user's run page is not the admin's to open
    assert "alice trains" in row(html, "run", trained.id) and trained.id in resident
    assert [(cell(row(html, "run", run.id), "status"), cell(row(html, "run", run.id), "step"),
             cell(row(html, "run", run.id), "activity")) for run in (trained, idle, theirs)] == [
        ("active", "1", "just now"), ("active archived", "0", "just now"), ("active", "0", "2 h ago")]

    assert ticks_on(html) == sorted((t["number"], t["fb_rows"] + t["decode_rows"], t["base_passes"] + t["decode_passes"])
                                    for t in state["ticks"]["recent"])
    assert any(rows >= 1 and passes >= 1 for _, rows, passes in ticks_on(html))  # alice's forward_backward
    base = row(html, "base", state["bases"][0]["name"])
    assert f'<td class="num">{state["bases"][0]["resident_runs"]}</td>' in base
    # Named as the catalogue names it; what the runtime loaded (the tiny model's path here) only under that name.
    loaded = state["bases"][0]["name"]
    shown = re.search(r"<strong>(.*?)</strong>", base)
    assert shown and shown.group(1) == TINY_MODEL and loaded != TINY_MODEL
    assert f'<code class="base-key">{loaded}</code>' in base


def test_revoking_a_users_key_from_the_admin_page_makes_it_401_and_nobody_else_may(live_server: LiveServer,
                                                                                 admin: Visitor) -> None:
    secret = api_key_for(live_server, "carol@example.com")
    models = f"{live_server.url}/v1/models"
    assert httpx.get(models, headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    html = admin.client.get("/admin").text
    key_id = re.search(r'<tr data-key-id="([^"]+)">\s*<td>carol@example.com</td>', html)
    user_id = re.search(r'/admin/users/([^/"]+)/disabled', row(html, "user", "carol@example.com"))
    assert key_id and user_id, "carol's key is listed with its owner, and she can be disabled"

    bystander = sign_in(live_server, "dave@example.com")  # signed in, not an admin
    assert bystander.client.get("/admin").status_code == 404
    assert bystander.delete(f"/admin/keys/{key_id.group(1)}").status_code == 404
    assert bystander.post(f"/admin/users/{user_id.group(1)}/disabled", data={"disabled": "1"}).status_code == 404
    assert httpx.get(models, headers={"Authorization": f"Bearer {secret}"}).status_code == 200  # still live
    assert cell(row(admin.client.get("/admin").text, "user", "carol@example.com"), "status") == "active"

    revoked = admin.delete(f"/admin/keys/{key_id.group(1)}")
    assert revoked.status_code == 200 and key_id.group(1) not in revoked.text
    assert cell(row(revoked.text, "user", "carol@example.com"), "keys") == "0"
    refused = httpx.get(models, headers={"Authorization": f"Bearer {secret}"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_the_ticks_chart_draws_the_runtimes_recent_ticks(browser: Browser, live_server: LiveServer) -> None:
    client = SignalClient(api_key=api_key_for(live_server, "erin@example.com"), base_url=live_server.url)
    client.create_run(lora_r=4).forward_backward(batch=BATCH)
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(mint_login_link(live_server, "chief@example.com", is_admin=True))
        page.wait_for_url("**/runs")
        page.goto(f"{live_server.url}/admin")
        chart = page.locator(".ticks-chart")
        table_rows = page.locator("tr[data-tick]").count()
        assert table_rows >= 1
        # static/admin.js sets data-points once uPlot has drawn every tick of the table.
        page.wait_for_selector(f'.ticks-chart[data-points="{table_rows}"] canvas')
        assert "rows" in chart.locator(".u-legend").inner_text() and "seconds" in chart.locator(".u-legend").inner_text()
        assert errors == []
    finally:
        context.close()


def test_the_runtime_card_fits_at_1280_px_and_names_backend_and_threads_in_words(browser: Browser,
                                                                                    live_server: LiveServer) -> None:
    client = SignalClient(api_key=api_key_for(live_server, "fits@example.com"), base_url=live_server.url)
    client.create_run(lora_r=4).forward_backward(batch=BATCH)  # a base loaded: the table has its row
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        page.goto(mint_login_link(live_server, "chief@example.com", is_admin=True))
        page.wait_for_url("**/runs")
        page.goto(f"{live_server.url}/admin")
        assert page.locator(".stat").filter(has_text="Backend").locator(".stat-value").inner_text() == "local process"
        # The runtime's own torch.get_num_threads(), in its runtime_state answer: the setting reached its process.
        assert page.locator('[data-cell="device"]').inner_text() == f"on cpu, {THREADS} threads"
        widths = page.locator(".runtime-pool .table-scroll").first.evaluate(
            "el => [el.scrollWidth, el.clientWidth, el.closest('.card').getBoundingClientRect().right, innerWidth]")
        scroll_width, client_width, card_right, viewport = widths
        assert scroll_width <= client_width and card_right <= viewport, widths  # nothing clipped, nothing to scroll
    finally:
        context.close()


def test_a_call_held_queued_shows_in_the_queue_by_user(live_server: LiveServer, admin: Visitor) -> None:
    email = "queued@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    assert 'data-queue="queued@example.com"' not in admin.client.get("/admin").text
    # The run's next ticket is taken (as a server process that has not sent its call yet would: the technique of
    # tests/faults/test_deadlines.py), so this forward_backward waits in the runtime's queue for it.
    change_run(live_server, run.id, call_seq=Run.call_seq + 1)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(run.forward_backward, batch=BATCH)
        live_server.wait_for(lambda: sum(runtime_state(live_server)["queue_depth"].values()) == 1 or held.done(),
                             "the held call to queue")
        assert not held.done()
        queue = row(admin.client.get("/admin").text, "queue", email)
        assert re.findall(r'<td class="num">(\d+)</td>', queue) == ["1", "0"]  # one call queued, none refused
        live_server.backend.client.submit("run_info", run_id=run.id, ticket=1).result(timeout=60)  # ticket 1 comes
        assert held.result(timeout=120).num_tokens > 0
    assert 'data-queue="queued@example.com"' not in admin.client.get("/admin").text
