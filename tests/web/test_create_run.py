"""Create a run from the dashboard (issue 18 §1): the New run form on the Modal backend offers a GPU picker whose fit
check refuses a model too large for the chosen GPU inside the form, and a run it creates (8-bit, the form saying it
is loading meanwhile) trains through the SDK by its id; a second run may take the same name. Modal's cloud cannot be
reached from here: the server runs its Modal backend on Modal's offline path (`.local()` of the app's class,
tests/helpers/modal_server.py's stand-in), with a real server and real Chromium."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, Route, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for, write_catalog
from tests.web.conftest import api_key_for, mint_login_link

expect.set_options(timeout=30_000)
pytestmark = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")

BIG = "signal-tests/declared-70b"  # the tiny model's weights under a 70B parameter count: only the fit check reads it
BATCH = [{"tokens": [1, 2, 3, 4, 5], "weights": [0, 1, 1, 1, 1]}]


@pytest.fixture(scope="module")
def modal_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from app.backends.modal import ModalBackend
    from gpu_runtime import modal_app

    root = tmp_path_factory.mktemp("create-run")
    catalog = write_catalog(root / "models.yaml", tiny_model_dir)
    catalog.write_text(catalog.read_text() + f"- {{name: {BIG}, path: {tiny_model_dir}, family: llama, "
                       "parameters: 70_600_000_000, offline: true}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(modal_app.DATA_DIR_ENV, str(root / "volume"))
        patch.setenv(modal_app.DEVICE_ENV, "cpu")
        patch.setenv(modal_app.DOWNLOADS_ENV, "0")
        settings = settings_for(root / "server", tiny_model_dir, backend="modal", models_file=catalog)
        server = LiveServer.start(settings, backend=ModalBackend(settings, lookup=lambda: modal_app.Pool, local=True))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def page(wide_page: Page) -> Page:
    return wide_page


def test_a_run_made_from_the_form_trains_through_the_sdk_and_a_misfit_gpu_is_refused_inline(
        page: Page, modal_server: LiveServer) -> None:
    email = "new-run@example.com"
    page.goto(mint_login_link(modal_server, email))
    page.wait_for_url(f"{modal_server.url}/runs")
    page.get_by_role("link", name="New run").click()
    page.wait_for_url(f"{modal_server.url}/runs/new")

    # A 70B base on one T4: the allocation's fit check answers in the form, beside the GPU picker, with what was typed.
    page.get_by_label("Name", exact=True).fill("too big")
    page.get_by_label("Base model").select_option(BIG)
    page.get_by_label("GPUs").select_option("T4:1")
    page.get_by_role("button", name="Create run").click()
    alert = page.locator("#new-run-error")
    expect(alert).to_contain_text(BIG)
    expect(alert).to_contain_text("T4")
    expect(page.get_by_label("GPUs")).to_have_attribute("aria-invalid", "true")
    expect(page.get_by_label("GPUs")).to_have_value("T4:1")
    expect(page.get_by_label("Name", exact=True)).to_have_value("too big")
    assert page.url == f"{modal_server.url}/runs/new"

    # The tiny model on its own allocation, 8-bit, rank 4, a learning rate and a tag: created, and its page opens.
    page.get_by_label("Name", exact=True).fill("from the form")
    page.get_by_label("Base model").select_option(TINY_MODEL)
    page.get_by_label("GPUs").select_option("")
    page.get_by_label("Quantization").select_option("8bit")
    page.get_by_label("LoRA rank").fill("4")
    page.get_by_label("Learning rate").fill("0.002")
    page.get_by_label("Tags").fill("ui, sweep")
    # While the base loads the form says so (#new-run-pending) and its button is disabled: the POST is held here
    # until both are seen, then let through.
    held: list[Route] = []
    page.route("**/runs/new", lambda route: held.append(route) if route.request.method == "POST" else route.continue_())
    page.get_by_role("button", name="Create run").click()
    expect(page.locator("#new-run-pending")).to_be_visible()
    expect(page.locator("#new-run-pending")).to_contain_text("Loading the base model")
    expect(page.get_by_role("button", name="Create run")).to_be_disabled()
    assert len(held) == 1
    held[0].continue_()
    page.wait_for_url(lambda url: url.startswith(f"{modal_server.url}/runs/") and not url.endswith("/new"))
    page.unroute("**/runs/new")
    run_id = page.url.rsplit("/", 1)[1]
    expect(page.get_by_role("heading", level=1)).to_contain_text("from the form")
    expect(page.locator("dt:text-is('Base weights') + dd")).to_have_text("8bit")

    # The same user's SDK trains it by its id.
    client = SignalClient(api_key=api_key_for(modal_server, email), base_url=modal_server.url)
    run = client.get_run(run_id)
    assert (run.name, run.info.lora_r, run.info.tags, run.info.base_model) == ("from the form", 4, ["ui", "sweep"],
                                                                             TINY_MODEL)
    assert run.info.learning_rate == pytest.approx(0.002)
    assert run.forward_backward(batch=BATCH).num_tokens > 0
    assert run.optim_step().step == 1

    # Names are not unique (issue 18 §1): a second run by the same name is made, and both are listed by it.
    twin = client.create_run(lora_r=4, name="from the form", quantization="8bit")
    assert twin.id != run_id and twin.name == "from the form"
    page.goto(f"{modal_server.url}/runs?q=from+the+form")
    expect(page.locator("#runs-table tbody tr")).to_have_count(2)
    expect(page.locator("#runs-table [data-cell=name]")).to_have_text(["from the form", "from the form"])
