"""Runs you can tell apart (issue 18 §1) in the dashboard: the list shows names and tags, searches and sorts them
with the state in the URL, and the run page renames and tags a run. Real server, real Chromium, runs made through
the SDK."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, error_code
from tests.web.conftest import api_key_for, mint_login_link, sign_in

expect.set_options(timeout=30_000)


@pytest.fixture
def page(wide_page: Page) -> Page:
    return wide_page


def test_rename_and_tag_a_run_then_find_it_by_filter(page: Page, live_server: LiveServer) -> None:
    email = "run-labels@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    first = client.create_run(lora_r=4, name="baseline", tags=["sft"])
    client.create_run(lora_r=4, name="wider lora")
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    rows = page.locator("#runs-table tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("wider lora")
    expect(rows.nth(1)).to_contain_text("baseline")
    expect(rows.nth(1).locator(".tag")).to_have_text(["sft"])

    # Rename and retag on the run's page.
    page.get_by_role("link", name="baseline").click()
    page.wait_for_url(f"{live_server.url}/runs/{first.id}")
    expect(page.get_by_role("heading", level=1)).to_contain_text("baseline")
    page.get_by_label("Name", exact=True).fill("baseline, lr 1e-4")
    page.get_by_label("Tags").fill("sft, sweep-7")
    page.get_by_label("Note").fill("the one to beat")
    page.get_by_role("button", name="Save labels").click()
    expect(page.locator("#run-labels").get_by_role("status")).to_have_text("Saved.")
    expect(page.get_by_role("heading", level=1)).to_contain_text("baseline, lr 1e-4")
    expect(page.locator("#run-labels .tag")).to_have_text(["sft", "sweep-7"])
    expect(page.locator("#run-note")).to_have_text("the one to beat")
    assert client.get_run(first.id).name == "baseline, lr 1e-4"

    # An empty name is refused with the server's words, and the name stays.
    page.get_by_label("Name", exact=True).fill(" ")
    page.get_by_label("Name", exact=True).evaluate("input => input.removeAttribute('required')")
    page.get_by_role("button", name="Save labels").click()
    expect(page.locator("#toasts")).to_contain_text("name is empty")
    expect(page.get_by_role("heading", level=1)).to_contain_text("baseline, lr 1e-4")

    # Back on the list: filter by a tag; the filter lives in the URL and survives a reload.
    page.get_by_role("link", name="Runs", exact=True).first.click()
    page.get_by_role("searchbox", name="Search runs").fill("SWEEP")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url(f"{live_server.url}/runs?q=SWEEP&sort=newest&show=")
    expect(rows).to_have_count(1)
    expect(rows.nth(0).get_by_role("link")).to_have_text("baseline, lr 1e-4")
    page.reload()
    expect(rows).to_have_count(1)
    expect(page.get_by_role("searchbox", name="Search runs")).to_have_value("SWEEP")
    # A run the filter hides is not announced as new.
    client.create_run(lora_r=4, name="unrelated")
    page.goto(f"{live_server.url}/runs?q=nothing-has-this&sort=newest")
    expect(page.get_by_role("heading", name="No runs match “nothing-has-this”")).to_be_visible()

    # Sorted by name, A to Z.
    page.goto(f"{live_server.url}/runs?sort=name")
    expect(page.get_by_role("combobox", name="Sort runs")).to_have_value("name")
    expect(rows.locator("[data-cell=name]")).to_have_text(["baseline, lr 1e-4", "unrelated", "wider lora"])
    expect(page.locator("#runs-new")).to_be_hidden()


def test_another_user_cannot_rename_your_run_from_the_dashboard(live_server: LiveServer) -> None:
    owner = SignalClient(api_key=api_key_for(live_server, "labels-owner@example.com"), base_url=live_server.url)
    run = owner.create_run(lora_r=4, name="mine")
    stranger = sign_in(live_server)
    try:
        answer = stranger.post(f"/runs/{run.id}/labels", data={"name": "theirs", "tags": "", "note": ""})
        assert answer.status_code == 404, answer.text
        # Without the CSRF token, nobody's form is taken.
        forged = stranger.client.post(f"/runs/{run.id}/labels", data={"name": "theirs"})
        assert forged.status_code == 403
    finally:
        stranger.client.close()
    assert owner.get_run(run.id).name == "mine"


def test_the_owners_delete_on_the_run_page_removes_the_run_and_its_files(live_server: LiveServer) -> None:
    owner = sign_in(live_server)
    key = api_key_for(live_server, owner.email)
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, name="to delete")
    saved = run.save_state(mode="adapter")
    [run_dir] = live_server.settings.data_dir.glob(f"runs/*/{run.id}")
    assert Path(saved.checkpoint_path).is_relative_to(run_dir) and Path(saved.checkpoint_path).is_dir()
    stranger = sign_in(live_server)
    try:
        assert f'hx-delete="/runs/{run.id}"' in owner.client.get(f"/runs/{run.id}").text  # the page's Delete
        assert owner.client.delete(f"/runs/{run.id}").status_code == 403  # without the CSRF token: refused
        assert stranger.delete(f"/runs/{run.id}").status_code == 404  # another's run: not found, and kept
        assert run_dir.is_dir()
        deleted = owner.delete(f"/runs/{run.id}")
        assert deleted.status_code == 204 and deleted.headers["hx-redirect"] == "/runs"
        assert owner.client.get(f"/runs/{run.id}").status_code == 404
        assert not run_dir.exists()
        gone = live_server.graphql("query($id: ID!) { run(id: $id) { id } }", {"id": run.id}, key=key)
        assert error_code(gone) == "NOT_FOUND", gone
        assert run.id not in owner.client.get("/runs").text
    finally:
        stranger.client.close()
        owner.client.close()


def test_archive_hides_a_run_until_shown_and_unarchived(page: Page, live_server: LiveServer) -> None:
    email = "run-archive@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    run = client.create_run(lora_r=4, name="finished sweep")
    client.create_run(lora_r=4, name="still going")
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    page.get_by_role("link", name="finished sweep").click()
    page.wait_for_url(f"{live_server.url}/runs/{run.id}")  # loaded: htmx handles the buttons from here
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Archive", exact=True).click()
    expect(page.get_by_role("button", name="Unarchive")).to_be_visible()
    expect(page.get_by_role("heading", level=1)).to_contain_text("archived")

    rows = page.locator("#runs-table tbody tr")
    page.goto(f"{live_server.url}/runs")
    expect(rows.locator("[data-cell=name]")).to_have_text(["still going"])
    page.get_by_role("combobox", name="Show runs").select_option(label="Archived")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url(f"{live_server.url}/runs?q=&sort=newest&show=archived")
    expect(rows.locator("[data-cell=name]")).to_have_text(["finished sweep"])
    expect(rows.nth(0)).to_contain_text("archived")

    page.get_by_role("link", name="finished sweep").click()
    page.wait_for_url(f"{live_server.url}/runs/{run.id}")
    page.get_by_role("button", name="Unarchive").click()
    expect(page.get_by_role("button", name="Archive", exact=True)).to_be_visible()
    assert client.get_run(run.id).info["archived_at"] is None


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"loraR": "four"}, "loraR", "loraR must be a whole number"),
    ({"loraR": "4", "loraAlpha": "1e308"}, "loraAlpha", "alpha"),
    ({"learningRate": "fast"}, "learningRate", "learningRate must be a number"),
])
def test_the_new_run_form_shows_the_device_here_and_refuses_bad_settings_beside_their_field(
        live_server: LiveServer, fields: dict[str, str], field: str, words: str) -> None:
    visitor = sign_in(live_server)
    form = visitor.client.get("/runs/new").text
    assert '<code>cpu</code>' in form and 'name="gpuConfig"' not in form  # locally: the device, no GPU picker
    answer = visitor.post("/runs/new", data={"baseModel": TINY_MODEL, **fields})
    assert answer.status_code == 200 and "hx-redirect" not in answer.headers
    assert 'role="alert"' in answer.text and words in answer.text
    assert re.search(rf'name="{field}"[^>]*aria-invalid="true"', answer.text)  # the field is marked, for readers
    assert SignalClient(api_key=api_key_for(live_server, visitor.email), base_url=live_server.url).list_runs() == []
