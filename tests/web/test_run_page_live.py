"""The run page's live view (issue 18): samples made through the SDK appear without a reload, over the page's one
event stream, each once (bug 6); the chart plots loss against call, step (the token-weighted mean of the step's
calls) or wall time, with smoothing, a log scale, and a CSV export of every metric row (§2); grad norm, learning
rate, tokens and throughput have charts of their own, every chart has a table view and zooms with a reset, and
checkpoints and samples are marked on the loss chart (§2)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import datetime

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import select

from app.db import Database
from app.tables import CallRecord
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, settings_for
from tests.web.conftest import api_key_for, mint_login_link, run_async

expect.set_options(timeout=30_000)


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """This module's server: its run pages' streams poll once an hour, so whatever a page shows live (a sample, a
    checkpoint, a metric) came from this process waking the stream as it recorded the row."""
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-live"), tiny_model_dir, live_poll_s=3600))
    yield server
    server.stop()


def test_sdk_samples_appear_on_the_open_run_page(wide_page: Page, live_server: LiveServer) -> None:
    email = "live-samples@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(lora_r=4, seed=2)
    before = run.sample(prompts=["Before the page"], max_tokens=3, temperature=0.5)["outputs"][0]
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto("about:blank")  # the runs list's own stream ends here, so only the run page's requests count
    streams: list[str] = []
    wide_page.on("request", lambda request: streams.append(request.url) if "/events" in request.url else None)
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#live-state")).to_have_attribute("data-state", "live")
    items = wide_page.locator("#samples-list > li")
    expect(items).to_have_count(1)
    expect(items.first.locator(".sample-output")).to_have_text(before)

    after = run.sample(prompts=["While the page is open"], max_tokens=4, temperature=0.9)["outputs"][0]
    expect(items).to_have_count(2)  # the new one, once; the old one not sent again
    expect(items.first.locator(".sample-prompt")).to_have_text("While the page is open")
    expect(items.first.locator(".sample-output")).to_have_text(after)
    expect(items.first.locator(".sample-meta")).to_contain_text("temperature 0.9")
    assert [url.split("?")[0] for url in streams] == [f"{live_server.url}/runs/{run.id}/events"]  # one stream


def test_the_first_sample_replaces_the_empty_state(wide_page: Page, live_server: LiveServer) -> None:
    email = "first-sample@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(lora_r=4)
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#live-state")).to_have_attribute("data-state", "live")
    expect(wide_page.locator("#samples-empty")).to_be_visible()
    run.sample(prompts=["First"], max_tokens=2)
    expect(wide_page.locator("#samples-list > li")).to_have_count(1)
    expect(wide_page.locator("#samples-empty")).to_have_count(0)


SHORT = [{"input": "The quick brown fox", "output": " jumps."}]
LONG = [{"input": "The quick brown fox", "output": " jumps over the lazy dog and runs far into the woods."},
        {"input": "Once upon a time", "output": " there was a tiny model that learned to count."}]


CHARTS = ("loss", "grad_norm", "learning_rate", "num_tokens", "throughput")
METRIC = {"loss": "loss:mean", "grad_norm": "grad_norm", "learning_rate": "learning_rate", "num_tokens": "num_tokens",
          "throughput": "throughput"}


def chart(page: Page, name: str = "loss") -> tuple[int, float]:
    """How many points chart `name` draws, and the last value of its top series (the smoothed one when smoothing)."""
    shown, last = page.locator(f"#{name}-chart").evaluate("(el) => [el.dataset.shown, el.dataset.last]")
    return int(shown), float(last)


def smoothed_last(values: list[float], factor: float) -> float:
    """The last point of a debiased exponential moving average (TensorBoard's smoothing)."""
    average = 0.0
    for value in values:
        average = factor * average + (1 - factor) * value
    return average / (1 - factor ** len(values))


def test_every_chart_against_call_step_and_time_smoothed_logged_and_exported(wide_page: Page,
                                                                             live_server: LiveServer) -> None:
    email = "chart@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(
        lora_r=4, seed=6, learning_rate=0.01)
    for rate in (0.01, 0.004):  # two steps of two calls each, of different sizes: the step's loss weighs them by tokens
        run.forward_backward(batch=SHORT)
        run.forward_backward(batch=LONG)
        run.optim_step(learning_rate=rate)
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#loss-chart")).to_have_attribute("data-points", "4")  # no string predicate: CSP

    exported = wide_page.request.get(f"{live_server.url}/runs/{run.id}/metrics.csv")
    assert exported.status == 200 and exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text())))
    assert [r["name"] for r in rows].count("loss:mean") == 4 and [r["name"] for r in rows].count("grad_norm") == 2
    values = {name: [float(r["value"]) for r in rows if r["name"] == metric] for name, metric in METRIC.items()}
    losses, tokens, throughputs = values["loss"], values["num_tokens"], values["throughput"]
    steps = [int(r["step"]) for r in rows if r["name"] == "loss:mean"]
    optim_steps = [int(r["step"]) for r in rows if r["name"] == "grad_norm"]
    assert tokens[0] != tokens[1]  # the weighting below is not a plain mean

    # Against the call (the default): every chart's latest point is its latest value; the optimizer's charts sit at
    # the number of calls each optim_step applied.
    for name in CHARTS:
        assert chart(wide_page, name) == pytest.approx((len(values[name]), values[name][-1])), name
    expect(wide_page.locator("#grad_norm-chart")).to_have_attribute(
        "data-x-max", str(sum(step < optim_steps[-1] for step in steps)))

    # Against the step: one point per step in every chart, each from that step's calls.
    wide_page.select_option("#chart-x", "step")
    last_step = max(steps)
    last = [i for i, step in enumerate(steps) if step == last_step]
    weight = sum(tokens[i] for i in last)
    assert chart(wide_page) == pytest.approx((2, sum(losses[i] * tokens[i] for i in last) / weight))
    assert chart(wide_page, "num_tokens") == pytest.approx((2, weight / len(last)))  # tokens per call: their mean
    seconds = sum(tokens[i] / throughputs[i] for i in last)
    assert chart(wide_page, "throughput") == pytest.approx((2, weight / seconds))  # the step's tokens ÷ its seconds
    assert chart(wide_page, "grad_norm") == pytest.approx((2, values["grad_norm"][-1]))
    expect(wide_page.locator("#grad_norm-chart")).to_have_attribute("data-x-max", str(optim_steps[-1]))
    expect(wide_page.locator("#chart-note")).to_contain_text("token-weighted mean")

    # Against wall time, from the first call: the last optim_step sits at its seconds after it.
    wide_page.select_option("#chart-x", "time")
    times = {r["name"]: datetime.fromisoformat(r["created_at"]) for r in reversed(rows)}  # each name's first
    latest = {r["name"]: datetime.fromisoformat(r["created_at"]) for r in rows}  # each name's last
    assert chart(wide_page)[0] == 4
    x_max = float(wide_page.locator("#learning_rate-chart").get_attribute("data-x-max") or "nan")
    assert x_max == pytest.approx((latest["learning_rate"] - times["loss:mean"]).total_seconds(), abs=1e-3)

    # Smoothing and a log scale apply to every chart: a second, smoothed series on top, a logarithmic y scale.
    wide_page.select_option("#chart-x", "call")
    wide_page.locator("#chart-smooth").fill("0.5")
    wide_page.locator("#chart-log").check()
    for name in CHARTS:
        expect(wide_page.locator(f"#{name}-chart")).to_have_attribute("data-distr", "3")  # uPlot's log distribution
        expect(wide_page.locator(f"#{name}-chart")).to_have_attribute("data-series", "2")
        assert chart(wide_page, name) == pytest.approx((len(values[name]), smoothed_last(values[name], 0.5))), name
    expect(wide_page.locator("#loss-chart canvas")).to_have_count(1)  # redrawn once
    assert wide_page.locator("#loss-chart").evaluate("(el) => el.querySelectorAll('.u-legend .u-series').length") == 3
    # The table view lists the raw values, not the smoothed ones.
    wide_page.get_by_role("button", name="Table view").click()
    raw = [value for point in newest_first(by_call(list(enumerate(throughputs)))) for value in point]
    assert [value for row in table(wide_page, "throughput") for value in row] == pytest.approx(raw, rel=1e-5)
    wide_page.locator("#chart-log").uncheck()
    wide_page.locator("#chart-smooth").fill("0")
    for name in CHARTS:
        expect(wide_page.locator(f"#{name}-chart")).to_have_attribute("data-distr", "1")


def table(page: Page, name: str) -> list[tuple[float, ...]]:
    """The table view of chart `name`: its rows (newest first) as numbers."""
    cells = page.locator(f"#{name}-table tbody tr").evaluate_all(
        "(rows) => rows.map((row) => [...row.cells].map((cell) => cell.textContent))")
    return [tuple(float(cell) for cell in row) for row in cells]


def newest_first(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return list(reversed(points))


def by_call(rows: list[tuple[int, float]]) -> list[tuple[float, float]]:
    """(call number, value) for metric rows of forward_backward calls, in order."""
    return [(float(call), value) for call, (_, value) in enumerate(rows, 1)]


def fb_seconds(server: LiveServer, run_id: str) -> list[float]:
    """Each forward_backward's compute seconds, in order, from its call record."""
    async def read() -> list[float]:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                rows = await session.scalars(select(CallRecord.compute_seconds).where(
                    CallRecord.run_id == run_id, CallRecord.operation == "forward_backward")
                    .order_by(CallRecord.created_at))
                return [float(seconds) for seconds in rows]
        finally:
            await db.dispose()

    return list(run_async(read()))


def test_metric_charts_table_view_zoom_and_markers(wide_page: Page, live_server: LiveServer) -> None:
    email = "charts@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(
        lora_r=4, seed=7, learning_rate=0.01)
    for rate in (0.01, 0.004):  # two steps at two learning rates, so that chart is not one flat value
        run.forward_backward(batch=SHORT)
        run.forward_backward(batch=LONG)
        run.optim_step(learning_rate=rate)
        if rate == 0.01:  # at step 1: a sample marker from the page's first render, between calls 2 and 3
            run.sample(prompts=["Marked"], max_tokens=2)
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#loss-chart")).to_have_attribute("data-points", "4")
    api = {name: [(row.step, row.value) for row in run.metrics(name=name)]
           for name in ("loss:mean", "num_tokens", "throughput", "grad_norm", "learning_rate")}
    assert [value for _, value in api["learning_rate"]] == pytest.approx([0.01, 0.004])
    # Throughput is each call's tokens ÷ its compute seconds, recorded with the call.
    assert [value for _, value in api["throughput"]] == pytest.approx(
        [tokens / seconds for (_, tokens), seconds in zip(api["num_tokens"], fb_seconds(live_server, run.id))])
    expect(wide_page.locator("#stat-lr")).to_have_text("0.004")

    # The table view lists each chart's points, newest first: equal to what the API returns (6 significant digits).
    wide_page.get_by_role("button", name="Table view").click()
    expect(wide_page.locator("#loss-chart")).to_be_hidden()
    expect(wide_page.locator("#loss-table caption")).to_have_text("Loss: 4 points, newest first")
    # By forward_backward call; the optimizer's at the number of calls each optim_step applied.
    applied = [float(sum(call_step < step for call_step, _ in api["loss:mean"])) for step, _ in api["grad_norm"]]
    expected = {"loss": by_call(api["loss:mean"]), "num_tokens": by_call(api["num_tokens"]),
                "throughput": by_call(api["throughput"]),
                "grad_norm": list(zip(applied, [value for _, value in api["grad_norm"]])),
                "learning_rate": list(zip(applied, [value for _, value in api["learning_rate"]]))}
    for name, points in expected.items():
        shown = table(wide_page, name)
        assert len(shown) == len(points) == (2 if name in ("grad_norm", "learning_rate") else 4)
        for row, point in zip(shown, newest_first(points)):
            assert row == pytest.approx(point, rel=1e-5), name
    wide_page.get_by_role("button", name="Chart view").click()
    expect(wide_page.locator("#loss-table")).to_be_hidden()

    # Drag across the loss chart to zoom into it; Reset zoom brings back calls 1 to 4 whole.
    chart = wide_page.locator("#loss-chart")
    expect(chart).to_have_attribute("data-x-min", "1")
    expect(chart).to_have_attribute("data-x-max", "4")
    reset = wide_page.get_by_role("button", name="Reset zoom")
    expect(reset).to_have_count(0)  # hidden, and no other chart is zoomed
    box = chart.locator(".u-over").bounding_box()
    assert box is not None
    wide_page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] / 2)
    wide_page.mouse.down()
    wide_page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] / 2, steps=5)
    wide_page.mouse.up()
    expect(reset).to_be_visible()
    x_min, x_max = chart.evaluate("(el) => [Number(el.dataset.xMin), Number(el.dataset.xMax)]")
    assert 1 < x_min < x_max < 4
    reset.click()
    expect(chart).to_have_attribute("data-x-min", "1")
    expect(chart).to_have_attribute("data-x-max", "4")
    expect(reset).to_have_count(0)

    # The sample at step 1 is marked from the first render; a checkpoint saved through the SDK appears live, after
    # the four calls it holds (the range widens to show it), and the checkpoints card lists it.
    expect(chart).to_have_attribute("data-marks", "sample:1")
    # A Hub token half typed when the checkpoint arrives stays: only the card's list is fetched again.
    wide_page.locator("#push-hub summary").click()
    wide_page.locator("#push-repo").fill("me/half-typed")
    token = wide_page.locator("#push-token")
    token.press_sequentially("hf_half")
    run.save_state(name="marked")
    expect(chart).to_have_attribute("data-marks", "checkpoint:2 sample:1")
    expect(wide_page.locator("#chart-marks")).to_have_text("Checkpoints: marked (adapter) at step 2. Samples at step 1.")
    expect(chart).to_have_attribute("data-x-max", "4.5")
    marked = wide_page.locator("#checkpoints tr[data-checkpoint='adapter/marked']")
    expect(marked).to_have_count(1)
    expect(token).to_have_value("hf_half")
    expect(token).to_be_focused()
    expect(wide_page.locator("#push-repo")).to_have_value("me/half-typed")
    expect(wide_page.locator("#push-hub")).to_have_attribute("open", "")
    wide_page.once("dialog", lambda dialog: dialog.accept())  # hx-confirm asks first
    marked.get_by_role("button", name="Delete").click()  # a deleted checkpoint loses its marker
    expect(chart).to_have_attribute("data-marks", "sample:1")
    expect(wide_page.locator("#chart-marks")).to_have_text("No checkpoints yet. Samples at step 1.")

    # The other charts grow live from the same stream: one more step adds a point to each.
    run.forward_backward(batch=SHORT)
    grad_norm = run.optim_step(learning_rate=0.002).grad_norm
    for name, count in (("loss", "5"), ("num_tokens", "5"), ("throughput", "5"), ("grad_norm", "3"),
                        ("learning_rate", "3")):
        expect(wide_page.locator(f"#{name}-chart")).to_have_attribute("data-shown", count)
    expect(wide_page.locator("#stat-lr")).to_have_text("0.002")
    assert float(wide_page.locator("#stat-grad").inner_text()) == pytest.approx(grad_norm, rel=1e-3)

    # A sample made now, at step 3, is marked live on the loss chart (the one at step 1 came with the page).
    run.sample(prompts=["Marked live"], max_tokens=2)
    expect(chart).to_have_attribute("data-marks", "sample:1 sample:3")
    expect(wide_page.locator("#chart-marks")).to_have_text("No checkpoints yet. Samples at step 1, 3.")
