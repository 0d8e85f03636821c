"""The dashboard in a real browser (Debian's Chromium through Playwright) against a real server.

The main journey of issue 7: sign in with a login link, create a key, train through the SDK while the
run page is open and watch the chart grow without a reload, sample in the playground, download a
checkpoint and open the archive, revoke the key and see the SDK refused. Screenshots (1280 px wide) land in
build/screenshots/; `make screenshots` writes the committed set in tests/web/screenshots/ (tests/web/conftest.py).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Page, Route, ViewportSize, expect

from rewardsignal import AuthenticationError, SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import SCREENSHOT_CLOCK, api_key_for, committing_screenshots, mint_login_link, shot

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
VIEWPORT: ViewportSize = {"width": 1280, "height": 860}
# Generous: the server trains and samples on the same 2 CPU cores as this browser.
expect.set_options(timeout=30_000)


@pytest.fixture
def page(browser: Browser, live_server: LiveServer) -> Iterator[Page]:
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    if committing_screenshots():
        page.clock.set_fixed_time(SCREENSHOT_CLOCK)  # Date only: timers still run, so htmx and streams are unchanged
    yield page
    context.close()


def sign_in(page: Page, server: LiveServer, email: str) -> None:
    page.goto(mint_login_link(server, email))
    page.wait_for_url(f"{server.url}/runs")


def test_train_watch_sample_download_revoke(page: Page, live_server: LiveServer, tmp_path: Path) -> None:
    sign_in(page, live_server, "browser@example.com")
    expect(page.get_by_role("heading", name="No runs yet")).to_be_visible()
    shot(page, "runs-empty")

    # A key, its secret shown once.
    page.goto(f"{live_server.url}/keys")
    shot(page, "keys-empty")
    page.fill("#key-name", "browser test")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-secret").inner_text().strip()
    assert secret.startswith("sk-")
    expect(page.locator("#keys-table")).to_contain_text("browser test")

    # Train through the SDK while the run page is open: points arrive over server-sent events.
    client = SignalClient(api_key=secret, base_url=live_server.url)
    run = client.create_run(lora_r=4, learning_rate=0.05, seed=3)
    page.goto(f"{live_server.url}/runs/{run.id}")
    expect(page.locator("#live-state")).to_have_attribute("data-state", "live")
    shot(page, "run-waiting")
    for step in range(1, 4):
        run.forward_backward(batch=BATCH)
        run.optim_step()
        expect(page.locator("#loss-chart")).to_have_attribute("data-points", str(step))  # not a string predicate: CSP
    expect(page.locator("#stat-calls")).to_have_text("3")
    expect(page.locator("#stat-step")).to_have_text("3")
    assert page.locator("#loss-chart canvas").count() == 1  # uPlot drew it, no reload needed

    # Save now, then download the checkpoint as an archive and open it.
    page.get_by_role("button", name="Save now").click()
    link = page.get_by_role("link", name="Download .tar")
    expect(link).to_have_count(1)
    shot(page, "run")
    with page.expect_download() as download_info:
        link.click()
    archive = tmp_path / "checkpoint.tar"
    download_info.value.save_as(archive)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(name.endswith("adapter_config.json") for name in names), names

    # The playground samples from the run: n outputs.
    page.goto(f"{live_server.url}/playground?run={run.id}")
    page.fill("#prompt", "The quick brown fox")
    page.fill("#max_tokens", "6")
    page.fill("#num_samples", "2")
    page.get_by_role("button", name="Sample").click()
    expect(page.locator("#play-result .output")).to_have_count(2)
    shot(page, "playground")

    # Bad input is shown, never silently dropped.
    page.fill("#prompt", "")
    page.get_by_role("button", name="Sample").click()
    expect(page.locator(".toast.error")).to_contain_text("Write a prompt first")
    shot(page, "error-toast")

    # Revoke asks first; the key stops working at once.
    page.goto(f"{live_server.url}/keys")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Revoke").click()
    expect(page.locator("#keys-table .pill.muted")).to_have_text("revoked")
    with pytest.raises(AuthenticationError):
        client.list_runs()


def test_the_run_page_lists_names_and_deletes_checkpoints(page: Page, live_server: LiveServer) -> None:
    email = "checkpoints@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    run = client.create_run(lora_r=4, seed=1)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    sign_in(page, live_server, email)
    page.goto(f"{live_server.url}/runs/{run.id}")

    page.select_option("select[name=mode]", "state")
    page.fill("input[name=name]", "final")
    page.get_by_role("button", name="Save now").click()
    row = page.locator("#checkpoints tr[data-checkpoint='state/final']")
    expect(row.locator("code")).to_have_text("final")
    expect(row.locator("code")).to_have_attribute("title", f"signal://{run.id}/state/final: what load_state and "
                                                          "create_run(from_checkpoint=…) take")
    expect(row).to_contain_text("state")
    page.get_by_role("button", name="Save now").click()  # the same name and kind again: refused, shown
    expect(page.locator(".toast.error")).to_contain_text("already has a state checkpoint named 'final'")
    page.select_option("select[name=mode]", "adapter")
    page.get_by_role("button", name="Save now").click()  # the same name, another kind
    expect(page.locator("#checkpoints tbody tr")).to_have_count(2)
    shot(page, "run-checkpoints")

    (saved,) = [c for c in run.checkpoints() if c.mode == "state"]
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Delete").click()
    expect(page.locator("#checkpoints tbody tr")).to_have_count(1)
    expect(page.locator("#checkpoints tr[data-checkpoint='adapter/final']")).to_have_count(1)
    assert [(c.mode, c.name) for c in run.checkpoints()] == [("adapter", "final")]
    assert not Path(saved.checkpoint_path).exists()


def test_error_and_loading_states(page: Page, live_server: LiveServer) -> None:
    sign_in(page, live_server, "states@example.com")
    page.goto(f"{live_server.url}/runs/{'0' * 32}")
    expect(page.get_by_role("heading", name="Not found")).to_be_visible()
    shot(page, "error-not-found")

    # The playground's loading state, held open by delaying the sample request at the browser's edge.
    client = SignalClient(api_key=api_key_for(live_server, "states@example.com"), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    page.goto(f"{live_server.url}/playground?run={run.id}")
    page.fill("#prompt", "Once upon a time")
    held = []
    page.route("**/playground/stream", lambda route: held.append(route) if route.request.method == "POST" else route.continue_())
    page.get_by_role("button", name="Sample").click()
    expect(page.locator("#play-result .loading-note")).to_be_visible()
    shot(page, "playground-loading")
    held[0].continue_()
    expect(page.locator("#play-result .output")).to_have_count(1)


def test_login_page_without_supabase(page: Page, live_server: LiveServer) -> None:
    page.goto(f"{live_server.url}/runs")
    page.wait_for_url("**/login?next=/runs")
    expect(page.get_by_text("signal login-link")).to_be_visible()
    shot(page, "login")


def test_used_login_link_is_refused_in_the_browser(page: Page, live_server: LiveServer) -> None:
    link = mint_login_link(live_server, "twice@example.com")
    page.goto(link)
    page.wait_for_url("**/runs")
    page.context.clear_cookies()
    page.goto(link)
    # A lasting page, not a toast that fades (issue 18, bug 4): tests/web/test_sessions.py follows its link.
    expect(page.get_by_role("alert")).to_contain_text("used, has expired or is unknown")
    expect(page.get_by_role("link", name="Sign in again")).to_be_visible()
    shot(page, "error-login-link")


def test_graphiql_works_offline(page: Page, live_server: LiveServer) -> None:
    """GraphiQL's own run button answers `{ models { name } }` with every non-loopback request blocked."""
    outside: list[str] = []

    def only_loopback(route: Route) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_loopback)
    page.goto(f"{live_server.url}/graphql")
    expect(page.locator(".graphiql-execute-button")).to_be_visible()
    page.locator(".graphiql-execute-button").click()
    expect(page.locator(".result-window")).to_contain_text("tiny-llama")
    shot(page, "graphiql")
    assert outside == []
