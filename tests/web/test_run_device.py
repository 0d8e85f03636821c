"""What a run trains on and what the database knows of it, as the API, the runs pages and the admin page show them.

- `device` is what the runtime reported (this machine's CPU here), `gpuConfig` the allocation the run asked for; the
  pages show only the device where the backend has one device for every run (the local runtime: "cpu", never
  "cpu / asked L40S:1");
- `status` is active, or failed once the runtime answers that it no longer has the run;
- resident and evicted come from the runtime's own state, read when the admin page is.
"""

from __future__ import annotations

import re

import pytest

from rewardsignal import NotFoundError, SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import api_key_for, sign_in

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]
RUN = "query($id: ID!) { run(id: $id) { device gpuConfig status } }"


def definition(html: str, term: str) -> str:
    """The text of `<dt>term</dt><dd>…</dd>` on a page, tags dropped."""
    found = re.search(rf"<dt[^>]*>{re.escape(term)}</dt><dd>(.*?)</dd>", html, re.S)
    assert found, f"no {term!r} on the page"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_a_local_cpu_run_shows_the_device_it_trains_on_and_the_api_keeps_the_allocation_it_asked_for(live_server: LiveServer) -> None:
    visitor = sign_in(live_server, "device@example.com")
    client = SignalClient(api_key=api_key_for(live_server, "device@example.com"), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)

    assert (run.refresh().info["device"], run.info["gpu_config"]) == ("cpu", "L40S:1")  # the SDK's fragment
    body = live_server.graphql(RUN, {"id": run.id}, key=client.api_key)
    assert body["data"]["run"] == {"device": "cpu", "gpuConfig": "L40S:1", "status": "active"}

    page = visitor.client.get(f"/runs/{run.id}").text
    assert definition(page, "Device") == "cpu" and "Requested allocation" not in page and "L40S" not in page
    table = visitor.client.get("/runs/table").text
    assert "<th>Device</th>" in table and "<td><code>cpu</code></td>" in table
    assert "run-asked" not in table and "L40S" not in table  # the local runtime trains every run on its one device


def test_a_run_its_runtime_lost_is_failed_and_the_admin_page_counts_runs_live(live_server: LiveServer) -> None:
    admin, owner = sign_in(live_server, "runs-admin@example.com", is_admin=True), sign_in(live_server, "lost@example.com")
    client = SignalClient(api_key=api_key_for(live_server, "lost@example.com"), base_url=live_server.url)
    kept, lost = client.create_run(lora_r=4), client.create_run(lora_r=4)
    # The runtime forgets one (its files gone for good), behind the server's back.
    live_server.backend.client.submit("delete_run", run_id=lost.id).result(timeout=120)
    with pytest.raises(NotFoundError):
        lost.forward_backward(batch=BATCH)
    kept.forward_backward(batch=BATCH)

    assert live_server.graphql(RUN, {"id": lost.id}, key=client.api_key)["data"]["run"]["status"] == "failed"
    assert live_server.graphql(RUN, {"id": kept.id}, key=client.api_key)["data"]["run"]["status"] == "active"
    assert "failed</span>" in owner.client.get(f"/runs/{lost.id}").text.split("</h1>")[0]  # the run page's pill

    state = live_server.backend.client.submit("runtime_state").result(timeout=120)
    page = admin.client.get("/admin").text
    runs_in_db = len(live_server.graphql("{ runs { id } }", key=client.api_key)["data"]["runs"])
    assert runs_in_db == 2 and int(definition(page, "In the database")) >= runs_in_db
    assert definition(page, "Failed") == "1"
    assert int(definition(page, "Resident")) == len(state["resident_runs"]) >= 1  # kept, at least
    assert int(definition(page, "Evicted")) == len(state["evicted_runs"])
    assert kept.id in [r["run_id"] for r in state["resident_runs"]]
    assert lost.id not in [r["run_id"] for r in state["resident_runs"]] + state["evicted_runs"]
