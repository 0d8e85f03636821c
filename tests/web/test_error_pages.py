"""Every typed error reaches a dashboard visitor with its own HTTP status and its message (only INTERNAL is
masked and logged), as a page, as an htmx toast, and as a download's plain text; the status comes from the
error's class (app/errors.py), the one source.

The server is real, with billing pointed at the billing stand-in (tests/helpers/billing_standin.py, TESTS
ONLY): a playground sample with no credits left is a 402 that says so, not a 500. One route is added to the
real app for the test: it raises the error class named in its path, so every class is rendered, including
those no request can provoke on demand (WORKER_FAILED, HUB_ERROR).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import INTERNAL_STATUS, SignalError, http_status
from gpu_runtime.errors import _registry
from rewardsignal import SignalClient
from tests.helpers.billing_standin import BillingStandIn
from tests.helpers.live_server import LiveServer, settings_for
from tests.web.conftest import Visitor, api_key_for, sign_in
from web.render import INTERNAL_MESSAGE, signed_in, signed_in_or_key

SECRET = "billing-secret-errors-7a2c"
CLASSES = {cls.__name__: cls for cls in _registry().values()}


async def raise_named(request: Request, user: object) -> Response:
    cls = CLASSES[request.path_params["name"]]
    raise cls(f"what went wrong in {cls.__name__}", field="prompt")


@pytest.fixture(scope="module")
def billing() -> Iterator[BillingStandIn]:
    standin = BillingStandIn(secret=SECRET).start()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def server(billing: BillingStandIn, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("error-pages"), tiny_model_dir, frontier_backend_url=billing.url,
                            billing_secret=SECRET, billing_timeout_s=0.5, billing_retry_s=3600)
    live = LiveServer.start(settings)
    live.app.router.routes += [Route("/test-raise/{name}", signed_in(raise_named)),
                               Route("/test-download/{name}", signed_in_or_key(raise_named))]
    yield live
    live.stop()


@pytest.fixture(scope="module")
def visitor(server: LiveServer) -> Iterator[Visitor]:
    visitor = sign_in(server)
    yield visitor
    visitor.client.close()


@pytest.fixture(scope="module")
def program_key(server: LiveServer) -> str:
    return api_key_for(server, "program@example.com")


@pytest.fixture(autouse=True)
def approving(billing: BillingStandIn) -> None:
    billing.validate = "approve"


def test_only_internal_errors_have_the_internal_status() -> None:
    for cls in CLASSES.values():
        assert (http_status(cls) == INTERNAL_STATUS) == (cls.code == "INTERNAL"), cls


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_error_renders_with_its_status_and_message(name: str, server: LiveServer, visitor: Visitor,
                                                         program_key: str, caplog: pytest.LogCaptureFixture) -> None:
    cls: type[SignalError] = CLASSES[name]
    status = http_status(cls)
    shown = INTERNAL_MESSAGE if status == INTERNAL_STATUS else f"what went wrong in {name}"
    with caplog.at_level(logging.ERROR, logger="signal.web"):
        page = visitor.client.get(f"/test-raise/{name}")
        toast = visitor.client.get(f"/test-raise/{name}", headers={"HX-Request": "true"})
        download = httpx.get(f"{server.url}/test-download/{name}", headers={"Authorization": f"Bearer {program_key}"})
    assert page.status_code == toast.status_code == download.status_code == status
    assert shown in page.text and f"<div class=\"empty-code\">{status}</div>" in page.text
    assert toast.text == shown
    assert download.headers["x-signal-error-code"] == cls.code
    # Only what is ours to fix is logged as an exception.
    assert any(record.exc_info for record in caplog.records) == (status == INTERNAL_STATUS)


@pytest.mark.parametrize(("answer", "status", "message"), [
    ("refuse", 402, "Your balance is 0 credits: top up to keep training."),
    ("error", 503, "the billing service answered /internal/validate-credits with HTTP 500"),
])
def test_a_playground_sample_the_billing_backend_refuses_says_why(answer: str, status: int, message: str,
                                                                  server: LiveServer, visitor: Visitor,
                                                                  billing: BillingStandIn,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    run = SignalClient(api_key=api_key_for(server, visitor.email), base_url=server.url).create_run(lora_r=4)
    billing.validate = answer
    with caplog.at_level(logging.ERROR, logger="signal.web"):
        answered = visitor.post("/playground", data={"run_id": run.id, "prompt": "The meaning of life is",
                                                     "max_tokens": "4"})
    assert answered.status_code == status
    assert answered.text == message
    assert not any(record.exc_info for record in caplog.records)
