"""A Tinker session's end reaches its pending work (issue 34): closed (`/sessions/{id}/finish`, what
ServiceClient.close sends) or silent past SIGNAL_TINKER_SESSION_LAPSE_S, its pending futures fail in Tinker's shape
(category "user") and their samples are withdrawn in the runtime, as a revoked key's are. On a live server whose
futures re-check every 0.5 s and whose users have one call in flight (SIGNAL_MAX_USER_CALLS_IN_FLIGHT): a call held on
a run's ticket 2 keeps the user's one place, so the sample waits, pending, behind it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.faults.test_sample_shares import CREATE, PROMPT, runtime_state, shares, tinker_post
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

LAPSE_S = 20.0  # past the SDK's 10 s heartbeat, so a live client's session never lapses here


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("tinker-session-end"), tiny_model_dir,
                                          max_user_samples_in_flight=1, max_user_calls_in_flight=1,
                                          session_recheck_s=0.5, tinker_poll_s=1.0, tinker_session_lapse_s=LAPSE_S))
    yield server
    server.stop()


def withdrawn(server: LiveServer) -> int:
    return sum(runtime_state(server)["calls_withdrawn"].values())


def hold_the_place(server: LiveServer, key: str) -> tuple[str, Any]:
    """The user's one place in the runtime: a call on a run's ticket 2, waiting for ticket 1 (`release` sends it)."""
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    return run_id, server.backend.client.submit("run_info", run_id=run_id, ticket=2)


def release(server: LiveServer, run_id: str, holder: Any) -> None:
    assert server.backend.client.submit("run_info", run_id=run_id, ticket=1).result(timeout=60)["run_id"] == run_id
    assert holder.result(timeout=60)["run_id"] == run_id


def test_closing_a_session_fails_its_pending_sample_and_withdraws_it(live_server: LiveServer) -> None:
    import tinker
    from tinker import types

    key = live_server.new_user()
    client = tinker.ServiceClient(base_url=live_server.url, api_key="tml-" + key)
    sampler = client.create_sampling_client(base_model=TINY_MODEL).result()
    run_id, holder = hold_the_place(live_server, key)
    before = withdrawn(live_server)
    pending = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=2))
    live_server.wait_for(lambda: sum(runtime_state(live_server)["queue_depth"].values()) == 2, "the sample to wait")
    assert client._session_holder is not None
    session_id = client._session_holder.get_session_id()
    # What ServiceClient.close sends; the client itself stays open, so its pending future hears the answer.
    finished = httpx.post(f"{live_server.url}/api/v1/sessions/{session_id}/finish", timeout=60,
                          json={"reason": {"type": "interrupted"}, "detail": None}, headers={"X-API-Key": "tml-" + key})
    assert finished.status_code == 200
    with pytest.raises(tinker.RequestFailedError) as failed:
        pending.result(timeout=60)
    assert failed.value.category == types.RequestErrorCategory.User
    assert f"session {session_id} was closed" in str(failed.value)
    live_server.wait_for(lambda: withdrawn(live_server) == before + 1, "the sample to be withdrawn")
    assert shares(live_server).in_flight == {}
    release(live_server, run_id, holder)


def test_a_lapsed_session_fails_its_pending_sample_and_withdraws_it(live_server: LiveServer) -> None:
    """A client that died sends no heartbeat: past the lapse its session has ended, and so has its pending work."""
    key = live_server.new_user()
    session = tinker_post(live_server, key, "create_session", {"tags": []}).json()["session_id"]
    sampler = tinker_post(live_server, key, "create_sampling_session", {
        "session_id": session, "sampling_session_seq_id": 0, "base_model": TINY_MODEL}).json()["sampling_session_id"]
    run_id, holder = hold_the_place(live_server, key)
    before = withdrawn(live_server)
    request_id = tinker_post(live_server, key, "asample", {
        "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": PROMPT,
        "sampling_params": {"max_tokens": 2}}).json()["request_id"]
    polls: list[dict[str, Any]] = []

    def failed() -> bool:
        polls.append(tinker_post(live_server, key, "retrieve_future", {"request_id": request_id}).json())
        return "error" in polls[-1]

    live_server.wait_for(failed, "the future to fail", timeout=LAPSE_S + 60)
    assert polls[-1]["category"] == "user"
    assert f"session {session} sent no heartbeat for {LAPSE_S:g} s" in polls[-1]["error"]
    assert polls[0]["type"] == "try_again"  # pending until the lapse, not refused at once
    live_server.wait_for(lambda: withdrawn(live_server) == before + 1, "the sample to be withdrawn")
    assert shares(live_server).in_flight == {}
    release(live_server, run_id, holder)
