"""Checkpoints on Tinker's REST surface: ttl_seconds (the checkpoint lists its expires_at, and once past it the
housekeeping, the Tinker futures' heartbeat, deletes its files and row), storage usage, and signed download links. The test's server takes a 2 s TTL
(SIGNAL_TINKER_MIN_CHECKPOINT_TTL_S) and runs its housekeeping every 2 s (SIGNAL_TINKER_RESULT_TTL_S)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

TTL_S = 2
PATIENCE_S = 60.0


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(Path(tmp_path_factory.mktemp("tinker-ttl")), tiny_model_dir,
                                           tinker_min_checkpoint_ttl_s=TTL_S, tinker_result_ttl_s=float(TTL_S)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key(live_server: LiveServer) -> str:
    return "tml-" + live_server.new_user()


@pytest.fixture(scope="module")
def client(live_server: LiveServer, key: str) -> Any:
    import tinker

    return tinker.ServiceClient(base_url=live_server.url, api_key=key)


def checkpoint_files(server: LiveServer, name: str) -> list[Path]:
    return [p for p in (server.settings.data_dir / "runs").glob(f"**/{name}") if p.is_dir()]


def test_an_expired_checkpoint_is_deleted_files_and_row(live_server: LiveServer, client: Any, key: str) -> None:
    import tinker

    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    before = datetime.now(UTC)
    training.save_state("short", ttl_seconds=TTL_S).result()
    training.save_state("kept").result()
    rest = tinker.RestClient(base_url=live_server.url, api_key=key)
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed["weights/kept"].expires_at is None
    expires_at = listed["weights/short"].expires_at
    assert expires_at is not None and 0 < (expires_at - before).total_seconds() <= TTL_S + 30
    assert checkpoint_files(live_server, "short")
    # The housekeeping's own clock deletes it: the live server's condition wait, as every other test waits on one.
    live_server.wait_for(lambda: not checkpoint_files(live_server, "short"), "the expired checkpoint's sweep",
                         timeout=PATIENCE_S)
    assert not checkpoint_files(live_server, "short")
    ids = [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert ids == ["weights/kept"] and checkpoint_files(live_server, "kept")


@pytest.mark.parametrize("ttl", [TTL_S - 1, 3653 * 24 * 3600 + 1], ids=["too-short", "too-long"])
def test_a_ttl_out_of_bounds_is_a_user_error_naming_it(client: Any, ttl: Any) -> None:
    import tinker

    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError) as refused:
        training.save_state("bad", ttl_seconds=ttl).result()
    assert "ttl_seconds" in str(refused.value)


def test_storage_usage_counts_the_users_checkpoints(live_server: LiveServer) -> None:
    import tinker

    key = "tml-" + live_server.new_user()  # a user of its own: its usage is this test's checkpoints alone
    admin = tinker.AdminClient(base_url=live_server.url, api_key=key)
    (empty,) = admin.get_current_checkpoint_storage_usage().result().data
    assert (empty.checkpoint_count, empty.size_bytes) == (0, 0)
    training = tinker.ServiceClient(base_url=live_server.url, api_key=key).create_lora_training_client(
        base_model=TINY_MODEL, rank=4, seed=1).result()
    training.save_state("one").result()
    training.save_weights_for_sampler("two").result()
    listed = tinker.RestClient(base_url=live_server.url, api_key=key).list_checkpoints(training.model_id).result()
    (usage,) = admin.get_current_checkpoint_storage_usage().result().data
    assert usage.checkpoint_count == 2
    assert usage.size_bytes == sum(c.size_bytes or 0 for c in listed.checkpoints) > 0
    assert usage.size_gigabytes == pytest.approx(usage.size_bytes / 1e9)


def test_a_checkpoints_files_are_signed_links_that_need_no_key(live_server: LiveServer) -> None:
    import httpx
    import tinker

    key = "tml-" + live_server.new_user()
    training = tinker.ServiceClient(base_url=live_server.url, api_key=key).create_lora_training_client(
        base_model=TINY_MODEL, rank=4, seed=1).result()
    path = training.save_state("linked").result().path
    rest = tinker.RestClient(base_url=live_server.url, api_key=key)
    # The SDK's get_external_weights_urls takes external_weights paths only (refused client-side), which Signal never
    # makes: its route, read with the SDK's own response type, serves Signal's weights/ and sampler_weights/ paths.
    from tinker import types

    listed = httpx.get(f"{live_server.url}/api/v1/training_runs/{training.model_id}/checkpoints/weights/linked/"
                       "external_weights_urls", headers={"X-API-Key": key}, timeout=60)
    answer = types.ExternalWeightsUrlsResponse.model_validate(listed.json())
    assert path.endswith("/weights/linked") and answer.expires > datetime.now(UTC)
    (root,) = checkpoint_files(live_server, "linked")
    on_disk = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert set(answer.urls) == set(on_disk) and on_disk
    for relative, url in answer.urls.items():
        fetched = httpx.get(url, timeout=60)  # no key: the signature is the permission
        assert fetched.status_code == 200 and fetched.content == on_disk[relative]
    url = next(iter(answer.urls.values()))
    tampered = url[:-3] + ("AAA" if not url.endswith("AAA") else "BBB")
    assert httpx.get(tampered, timeout=60).status_code == 404
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(url, timeout=60).status_code == 404  # its checkpoint is gone: so is the link


def test_set_ttl_sets_clears_and_expires_a_checkpoint(live_server: LiveServer, client: Any, key: str) -> None:
    """RestClient.set_checkpoint_ttl_from_tinker_path (PUT …/ttl): a TTL set after the save lists its expires_at and
    the housekeeping deletes it once past; null clears a save's TTL."""
    import tinker

    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    later = training.save_state("later").result().path
    cleared = training.save_weights_for_sampler("cleared", ttl_seconds=3600).result().path
    rest = tinker.RestClient(base_url=live_server.url, api_key=key)
    before = datetime.now(UTC)
    assert rest.set_checkpoint_ttl_from_tinker_path(cleared, None).result() is None
    rest.set_checkpoint_ttl_from_tinker_path(later, 7200).result()
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed["sampler_weights/cleared"].expires_at is None
    expires_at = listed["weights/later"].expires_at
    assert expires_at is not None and 7200 <= (expires_at - before).total_seconds() <= 7200 + 30
    rest.set_checkpoint_ttl_from_tinker_path(later, TTL_S).result()
    live_server.wait_for(lambda: not checkpoint_files(live_server, "later"), "the expired checkpoint's sweep",
                         timeout=PATIENCE_S)
    ids = [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert ids == ["sampler_weights/cleared"]


@pytest.mark.parametrize("ttl", [TTL_S - 1, 3653 * 24 * 3600 + 1, "3600", True],
                         ids=["too-short", "too-long", "a-string", "a-boolean"])
def test_set_ttl_out_of_bounds_is_a_400_naming_it(live_server: LiveServer, client: Any, key: str, ttl: Any) -> None:
    import httpx

    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    training.save_state("bounded").result()
    answer = httpx.put(f"{live_server.url}/api/v1/training_runs/{training.model_id}/checkpoints/weights/bounded/ttl",
                       json={"ttl_seconds": ttl}, headers={"X-API-Key": key}, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["category"] == "user" and "ttl_seconds" in answer.json()["detail"]


def test_set_ttl_on_another_users_or_no_checkpoint_is_a_404(live_server: LiveServer, client: Any, key: str) -> None:
    import tinker

    training = client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=1).result()
    path = training.save_state("mine").result().path
    stranger = tinker.RestClient(base_url=live_server.url, api_key="tml-" + live_server.new_user())
    with pytest.raises(tinker.NotFoundError):
        stranger.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=live_server.url, api_key=key).set_checkpoint_ttl_from_tinker_path(
            path.replace("/mine", "/nobody"), 3600).result()
    listed = tinker.RestClient(base_url=live_server.url, api_key=key).list_checkpoints(training.model_id).result()
    assert [c.expires_at for c in listed.checkpoints] == [None]  # the stranger's call changed nothing
