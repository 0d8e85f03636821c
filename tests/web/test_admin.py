"""The admin page (issue 18 §7) against a real server, its runtime and Chromium: users with their run and key counts,
live keys across users (revoking one stops it at once), runs across users with where the runtime holds each, and the
runtime's bases, queue and recent ticks. Anyone else gets a 404 on every admin path. Disabling a user from this page
is tested with the other ways a session ends (tests/web/test_sessions.py)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link, sign_in

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
RESIDENCY = {"resident": "in memory", "evicted": "evicted to disk", "": "not loaded"}


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
