"""Every dashboard page, with something on it: the page list the phone and accessibility tests walk.

One admin user with two trained runs (one for the compare page), a checkpoint, a sample and a key, so the wide tables and cards are on screen.
"""

from __future__ import annotations

from dataclasses import dataclass

from playwright.sync_api import Browser, BrowserContext, Page, ViewportSize, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import SCREENSHOT_CLOCK, api_key_for, committing_screenshots, mint_login_link

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
# Page names, for test ids; "login" is the signed-out page, the rest are signed in as the admin.
PAGES = ["runs", "run", "keys", "start", "models", "admin", "account", "playground", "login", "graphql",
         "compare", "usage", "new-run"]
PHONE: ViewportSize = {"width": 390, "height": 844}
DESKTOP: ViewportSize = {"width": 1280, "height": 860}


@dataclass
class Tour:
    server: LiveServer
    email: str
    run_id: str
    other_run_id: str  # a second run, so the compare page has two

    def path(self, name: str) -> str:
        return {"run": f"/runs/{self.run_id}", "graphql": "/graphql", "login": "/login", "new-run": "/runs/new",
                "compare": f"/runs/compare?ids={self.run_id},{self.other_run_id}"}.get(name, f"/{name}")

    def context(self, browser: Browser, viewport: ViewportSize, signed_in: bool = True,
                bypass_csp: bool = False) -> BrowserContext:
        """A browser context, signed in as the tour's admin unless `signed_in` is false."""
        context = browser.new_context(viewport=viewport, bypass_csp=bypass_csp)
        if committing_screenshots():
            context.clock.set_fixed_time(SCREENSHOT_CLOCK)  # pictures that do not change with the time of day
        if not signed_in:
            return context
        page = context.new_page()
        page.goto(mint_login_link(self.server, self.email, is_admin=True))
        page.wait_for_url("**/runs")
        page.close()
        return context


def make_tour(server: LiveServer, email: str = "tour@example.com") -> Tour:
    # Made an admin here, where the user is created: signing in later never promotes anyone (the admin page was a 404).
    client = SignalClient(api_key=api_key_for(server, email, is_admin=True), base_url=server.url)
    run = client.create_run(lora_r=4, seed=1, name="a run name long enough to test wrapping on a phone screen",
                            tags=["phone", "layout"])
    run.forward_backward(batch=BATCH)
    run.optim_step()
    run.save_state(mode="adapter")
    run.sample(prompts=["The quick brown fox"], max_tokens=4)
    other = client.create_run(lora_r=8, seed=2, learning_rate=0.001, name="a second run to compare against")
    other.forward_backward(batch=BATCH)
    other.optim_step()
    return Tour(server, email, run.id, other.id)


def play_side_by_side(page: Page, tour: Tour) -> None:
    """The playground after one short prompt sampled from the tour's run and the base model, both panes done."""
    page.goto(f"{tour.server.url}/playground?run={tour.run_id}")
    page.select_option("#model-2", f"base:{TINY_MODEL}")
    page.fill("#system", "Be brief")
    page.fill("#prompt", "The quick brown fox")
    page.fill("#max_tokens", "4")
    page.get_by_role("button", name="Sample").click()
    panes = page.locator(".play-stream")
    expect(panes).to_have_count(2)
    for i in range(2):
        expect(panes.nth(i)).to_have_attribute("data-state", "done", timeout=60_000)
