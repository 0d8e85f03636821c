"""Counts on Tinker's wire are bounded before anything proportional to them is built (issue 34, finding 1): one
`asample` with num_samples 1,000,000,000 grew the server to 13.9 GB, one sequence id per sample, before the 1..16
bound was checked inside the future. Now it is a 400 naming the field, and the server and runtime carry on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

MAX_SAMPLES = 16  # gpu_runtime.contract.MAX_SAMPLES, as the SDK's users read it in docs/TINKER.md


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-bounds")), tiny_model_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wire(live_server: LiveServer) -> Any:
    headers = {"X-API-Key": "tml-" + live_server.new_user()}

    def post(path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{live_server.url}/api/v1/{path}", headers=headers, timeout=60, **kwargs)

    return post


@pytest.fixture(scope="module")
def sampler(wire: Any) -> str:
    session = wire("create_session", json={"tags": [], "display_name": "bounds"}).json()["session_id"]
    created = wire("create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": TINY_MODEL})
    assert created.status_code == 200, created.text
    return str(created.json()["sampling_session_id"])


def asample(wire: Any, sampler: str, seq: int, num_samples: object) -> httpx.Response:
    return wire("asample", json={"sampling_session_id": sampler, "seq_id": seq, "num_samples": num_samples,
                                 "prompt": {"chunks": [{"type": "encoded_text", "tokens": [100, 101]}]},
                                 "sampling_params": {"max_tokens": 1}})


@pytest.mark.parametrize("num_samples", [1_000_000_000, 300_000, MAX_SAMPLES + 1, 0, -1, 2**70, True, "4"],
                         ids=["billion", "300k", "one-over", "zero", "negative", "overflow", "bool", "string"])
def test_num_samples_out_of_bounds_is_a_400_naming_the_field(live_server: LiveServer, wire: Any, sampler: str,
                                                             num_samples: object) -> None:
    pid = live_server.worker_pid
    answer = asample(wire, sampler, 1, num_samples)
    assert answer.status_code == 400, answer.text
    assert answer.json()["category"] == "user" and "num_samples" in answer.json()["detail"]
    assert f"1..{MAX_SAMPLES}" in answer.json()["detail"]
    assert live_server.worker_pid == pid


def test_the_bound_itself_is_served(wire: Any, sampler: str) -> None:
    answer = asample(wire, sampler, 2, MAX_SAMPLES)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["sample_sequence_ids"]) == MAX_SAMPLES


def test_an_id_past_the_databases_integers_is_a_400(wire: Any, sampler: str) -> None:
    answer = wire("asample", json={"sampling_session_id": sampler, "seq_id": 2**70, "num_samples": 1,
                                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [100]}]},
                                   "sampling_params": {"max_tokens": 1}})
    assert answer.status_code == 400 and "seq_id" in answer.json()["detail"]
