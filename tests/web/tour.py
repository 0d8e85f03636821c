"""Every dashboard page, with something on it: the page list the phone and accessibility tests walk.

One admin user with two trained runs (one for the compare page), a checkpoint, a sample and a key, so the wide tables and cards are on screen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from playwright.sync_api import Browser, BrowserContext, Page, ViewportSize, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import SCREENSHOT_CLOCK, api_key_for, committing_screenshots, mint_login_link

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
# Page names, for test ids; SIGNED_OUT's are visited signed out, the rest signed in as the admin. "link" is the
# one-time sign-in link's page, "link-used" its error, "not-found" the 404 page, "signed-out" a run page after its
# stream said the session ended (the banner).
PAGES = ["runs", "run", "keys", "start", "models", "admin", "account", "playground", "login", "graphql",
         "compare", "usage", "new-run", "link", "link-used", "not-found", "signed-out"]
SIGNED_OUT = {"login", "link", "link-used"}
STATUS = {"link-used": 401, "not-found": 404}  # the pages not answered 200
PHONE: ViewportSize = {"width": 390, "height": 844}
# A phone, not a narrow desktop window: a mobile viewport lays a page out 980 px wide unless its viewport tag says
# otherwise, as a real phone does, and taps instead of clicking.
PHONE_DEVICE: dict[str, Any] = {"is_mobile": True, "has_touch": True, "device_scale_factor": 3}
DESKTOP: ViewportSize = {"width": 1280, "height": 860}


@dataclass
class Tour:
    server: LiveServer
    email: str
    run_id: str
    other_run_id: str  # a second run, so the compare page has two

    def path(self, name: str) -> str:
        if name == "link":  # a fresh link each visit (stage() keeps the page from using it)
            return mint_login_link(self.server, self.email, is_admin=True).removeprefix(self.server.url)
        return {"run": f"/runs/{self.run_id}", "graphql": "/graphql", "login": "/login", "new-run": "/runs/new",
                "compare": f"/runs/compare?ids={self.run_id},{self.other_run_id}", "signed-out": f"/runs/{self.run_id}",
                "link-used": "/auth/link?token=spent", "not-found": "/no-such-page"}.get(name, f"/{name}")

    def context(self, browser: Browser, viewport: ViewportSize, signed_in: bool = True,
                bypass_csp: bool = False) -> BrowserContext:
        """A browser context, signed in as the tour's admin unless `signed_in` is false."""
        device = PHONE_DEVICE if viewport == PHONE else {}
        context = browser.new_context(viewport=viewport, bypass_csp=bypass_csp, **device)
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


def stage(page: Page, name: str) -> None:
    """Before the visit. The link page posts its token on load and leaves: that post is answered with nothing, so the
    page stays as a visitor sees it while it signs them in."""
    if name == "link":
        page.route("**/auth/link", lambda route: route.fulfill(status=204) if route.request.method == "POST"
                   else route.continue_())


def finish(page: Page, name: str) -> None:
    """After the page is ready. "signed-out": the event the SSE extension fires when a stream closes on `signed-out`
    (static/app.js draws the banner from it); the real sign-out that sends it is tests/web/test_sessions.py's."""
    headings = {"link": "Signing you in…", "link-used": "This link cannot sign you in", "not-found": "Not found"}
    if name in headings:  # the page meant, still on screen
        expect(page.get_by_role("heading", name=headings[name], exact=True)).to_be_visible()
    if name == "signed-out":
        page.evaluate("document.body.dispatchEvent(new CustomEvent('htmx:sseClose', "
                      "{bubbles: true, detail: {type: 'message'}}))")
        expect(page.locator("#signed-out")).to_be_visible()


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
