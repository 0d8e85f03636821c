"""zstd request bodies on Tinker's wire (app/tinker/compression.py): client/config turns the SDK's compression on,
a compressed forward_backward trains as the same uncompressed one, and a small body that would decompress past
SIGNAL_MAX_REQUEST_BYTES (a zstd bomb) is a 413 JSON answer, as are garbage and unknown encodings 400s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zstandard

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for
from tests.tinker.test_wire import TOKENS, as_list, datum

MAX_REQUEST_BYTES = 1 << 20  # small, so the bomb below is one of a few kilobytes


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-zstd")), tiny_model_dir,
                                           max_request_bytes=MAX_REQUEST_BYTES))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key(live_server: LiveServer) -> str:
    return "tml-" + live_server.new_user()


def post(server: LiveServer, key: str, path: str, content: bytes, encoding: str, kind: str) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", content=content, timeout=60,
                      headers={"X-API-Key": key, "Content-Encoding": encoding, "Content-Type": kind})


def test_the_sdk_compresses_forward_backward_and_it_trains(live_server: LiveServer, key: str) -> None:
    import tinker

    client = tinker.ServiceClient(base_url=live_server.url, api_key=key)
    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    assert training.holder._client_config.proto_compress_fwdbwd is True
    weights = [1.0] * (len(TOKENS) - 1)
    out = training.forward_backward([datum(TOKENS, weights=weights)], "cross_entropy").result()
    logprobs = as_list(out.loss_fn_outputs[0]["logprobs"])
    assert out.metrics["loss:sum"] == pytest.approx(-sum(logprobs), rel=1e-5)


def test_a_zstd_json_body_is_read(live_server: LiveServer, key: str) -> None:
    body = zstandard.ZstdCompressor().compress(b'{"tags": [], "display_name": "zstd"}')
    answer = post(live_server, key, "create_session", body, "zstd", "application/json")
    assert answer.status_code == 200 and answer.json()["session_id"]


def test_a_zstd_bomb_is_refused_with_413(live_server: LiveServer, key: str) -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 * MAX_REQUEST_BYTES))  # 64 MiB of zeros
    assert len(bomb) < 16 * 1024
    answer = post(live_server, key, "forward_backward", bomb, "zstd", "application/x-protobuf")
    assert answer.status_code == 413
    assert answer.json()["category"] == "user" and "SIGNAL_MAX_REQUEST_BYTES" in answer.json()["detail"]
    # The server carries on.
    assert post(live_server, key, "create_session", b'{"tags": []}', "identity", "application/json").status_code == 200


@pytest.mark.parametrize(("content", "encoding"), [(b"not zstd at all", "zstd"), (b'{"tags": []}', "gzip")],
                         ids=["garbage", "gzip"])
def test_a_body_in_no_encoding_it_claims_or_an_unknown_one_is_400(live_server: LiveServer, key: str, content: bytes,
                                                                 encoding: str) -> None:
    answer = post(live_server, key, "create_session", content, encoding, "application/json")
    assert answer.status_code == 400 and answer.json()["category"] == "user"
