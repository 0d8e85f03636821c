"""Export and download (issue 8 §5), end to end through a real server and worker:

- save_state(push_to_hub=True) uploads the checkpoint, a model card naming the base model and the run's manifest
  to a private repo, through huggingface_hub's real client against a stand-in of the Hub at HF_ENDPOINT
  (tests/helpers/hub_standin.py: the network boundary, tests only); the user's token is sent as the
  Authorization header and found nowhere in the data directory or the worker's log;
- missing hubModelId / hfToken are BAD_INPUT naming the field; the Hub's refusals are HUB_ERROR with its message;
- the run page's push form does the same upload with the token it was given, which no file or row then holds;
- every checkpoint's downloadUrl serves its files as a .tar.gz to its owner (API key or session), 404 to others.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.db import Database
from app.tables import Base
from rewardsignal import AsyncSignalClient, BadInputError, HubError, NotFoundError, SignalClient
from tests.conftest import ON_POSTGRES
from tests.helpers.hub_standin import HubStandIn
from tests.helpers.live_server import LiveServer, settings_for
from tests.web.conftest import api_key_for, run_async, sign_in

HF_TOKEN = "hf_standin_7f3a9c1e5b2d4f6a8c0e"  # distinctive, so a grep for it finds every copy
BATCH = [{"input": "Q: What is 2 + 2?\nA:", "output": " 4"}, {"text": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandIn]:
    standin = HubStandIn(token=HF_TOKEN).start()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def server(hub: HubStandIn, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("export-data")
    # The runtime (a subprocess) inherits these: the Hub is the stand-in, reached over the LFS protocol (no Xet).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HUB_DISABLE_XET", "1")
        env.delenv("HF_TOKEN", raising=False)
        live = LiveServer.start(settings_for(data_dir, tiny_model_dir, worker_log=data_dir / "worker.log"))
    yield live
    live.stop()


def trained_run(client: SignalClient):  # type: ignore[no-untyped-def]
    run = client.create_run(lora_r=4, lora_alpha=8, seed=3)
    run.forward_backward(batch=BATCH)
    run.optim_step(learning_rate=1e-2)
    return run


def test_push_to_hub_uploads_a_private_repo_with_card_and_manifest(server: LiveServer, hub: HubStandIn,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    client = SignalClient(api_key=server.new_user(), base_url=server.url)
    run = trained_run(client)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)  # the SDK's default for hf_token
    artifact = run.save_state(mode="adapter", push_to_hub=True, hub_model_id="alice/tiny-adapter")

    repo = hub.repos["alice/tiny-adapter"]
    assert repo.private is True
    assert artifact.hub_url == f"{hub.url}/alice/tiny-adapter"  # stored on the checkpoint, and listed with it
    assert [c.hub_url for c in run.checkpoints()] == [artifact.hub_url]
    checkpoint = Path(artifact.checkpoint_path)  # the test shares the server's disk; the SDK never assumes it
    assert repo.files["adapter_model.safetensors"] == (checkpoint / "adapter_model.safetensors").read_bytes()
    assert json.loads(repo.files["adapter_config.json"]) == json.loads((checkpoint / "adapter_config.json").read_text())
    manifest = (checkpoint.parent.parent / "manifest.jsonl").read_bytes()
    assert repo.files["manifest.jsonl"] == manifest
    base_model = json.loads(manifest.splitlines()[0])["base_model"]["name"]
    card = repo.files["README.md"].decode()
    assert card.startswith("---\n") and f"\nbase_model: {base_model}\n" in card.split("---")[1]
    # The safetensors went through the LFS batch API and its upload action, then the NDJSON commit.
    oid = next(oid for oid, data in hub.lfs_objects.items() if data == repo.files["adapter_model.safetensors"])
    calls = hub.calls
    assert calls.index("POST /alice/tiny-adapter.git/info/lfs/objects/batch") < calls.index(f"PUT /lfs-objects/{oid}")
    assert calls[-1] == "POST /api/models/alice/tiny-adapter/commit/main"
    assert hub.authorizations and set(hub.authorizations) == {f"Bearer {HF_TOKEN}"}

    # Never stored: not in the run's files, the database, the worker's log, or anywhere in the data directory.
    leaks = [str(p) for p in Path(server.settings.data_dir).rglob("*") if p.is_file() and HF_TOKEN.encode() in p.read_bytes()]
    assert leaks == []
    assert (Path(server.settings.data_dir) / "worker.log").exists()


def test_the_run_pages_push_form_uploads_with_the_token_and_stores_it_nowhere(server: LiveServer,
                                                                              hub: HubStandIn) -> None:
    """Issue 18 §8: the dashboard's "Push to the Hub" form calls the same saveState(pushToHub) service. The Hub is
    the stand-in at HF_ENDPOINT (tests only: the real Hub cannot be reached from here)."""
    email = "pusher@example.com"
    run = trained_run(SignalClient(api_key=api_key_for(server, email), base_url=server.url))
    visitor = sign_in(server, email)
    form = visitor.client.get(f"/runs/{run.id}").text
    assert f'hx-post="/runs/{run.id}/push"' in form and 'name="hf_token" type="password"' in form
    seen = len(hub.authorizations)

    answer = visitor.post(f"/runs/{run.id}/push",
                          data={"mode": "adapter", "hub_model_id": "alice/from-the-page", "hf_token": HF_TOKEN})

    assert answer.status_code == 200, answer.text
    repo = hub.repos["alice/from-the-page"]
    assert repo.private is True and "adapter_model.safetensors" in repo.files and "README.md" in repo.files
    assert set(hub.authorizations[seen:]) == {f"Bearer {HF_TOKEN}"}  # the form's token, on every Hub call
    assert f'href="{hub.url}/alice/from-the-page"' in answer.text and HF_TOKEN not in answer.text
    # Not in any file of the data directory (the SQLite database and its WAL among them) nor in any table's rows.
    files = [p for p in Path(server.settings.data_dir).rglob("*") if p.is_file()]
    assert ON_POSTGRES or any(p.name == "signal.db" for p in files)
    assert [str(p) for p in files if HF_TOKEN.encode() in p.read_bytes()] == []
    assert HF_TOKEN not in every_row(server)


def every_row(server: LiveServer) -> str:
    """Every row of every table, as text: what the database holds, on SQLite or PostgreSQL."""

    async def read() -> str:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                return "\n".join([repr((await session.execute(select(table))).all())
                                  for table in Base.metadata.sorted_tables])
        finally:
            await db.dispose()

    return str(run_async(read()))


def test_push_to_hub_refusals_are_typed(server: LiveServer, hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    client = SignalClient(api_key=server.new_user(), base_url=server.url)
    run = trained_run(client)
    with pytest.raises(BadInputError) as no_repo:
        run.save_state(push_to_hub=True, hf_token=HF_TOKEN)
    assert no_repo.value.field == "hubModelId"
    with pytest.raises(BadInputError) as no_token:
        run.save_state(push_to_hub=True, hub_model_id="alice/x")
    assert no_token.value.field == "hfToken"
    with pytest.raises(BadInputError) as bad_name:
        run.save_state(push_to_hub=True, hub_model_id="alice/../x", hf_token=HF_TOKEN)
    assert bad_name.value.field == "hubModelId"
    wrong = "hf_wrong_token_0d9e8f7a6b5c"
    with pytest.raises(HubError) as refused:
        run.save_state(push_to_hub=True, hub_model_id="alice/refused", hf_token=wrong)
    assert refused.value.code == "HUB_ERROR" and "Invalid credentials in Authorization header" in str(refused.value)
    assert wrong not in str(refused.value) and "alice/refused" not in hub.repos
    assert not any(wrong.encode() in p.read_bytes() for p in Path(server.settings.data_dir).rglob("*") if p.is_file())


def test_download_url_serves_the_checkpoint_to_its_owner_only(server: LiveServer, tmp_path: Path) -> None:
    owner_key, other_key = server.new_user(), server.new_user()
    client = SignalClient(api_key=owner_key, base_url=server.url)
    run = trained_run(client)
    artifact = run.save_state(mode="state")
    assert artifact.download_url.startswith(server.url + f"/runs/{run.id}/checkpoints/")
    listed = run.checkpoints()[0]
    assert listed.download_url == artifact.download_url

    target = listed.download(tmp_path / "got")
    source = Path(artifact.checkpoint_path)
    expected = {p.relative_to(source): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    got = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert got == expected and Path("adapter_model.safetensors") in got and Path("optimizer_state.pt") in got

    async def download_async() -> Path:
        async with AsyncSignalClient(api_key=owner_key, base_url=server.url) as async_client:
            run_again = await async_client.get_run(run.id)
            (checkpoint,) = await run_again.checkpoints()
            return await checkpoint.download(tmp_path / "async")

    assert {p.relative_to(tmp_path / "async"): p.read_bytes() for p in asyncio.run(download_async()).rglob("*")
            if p.is_file()} == expected

    # Another user's key: 404, as for an id that does not exist; no key: the dashboard's sign-in; a bad key: 401.
    other = SignalClient(api_key=other_key, base_url=server.url)
    with pytest.raises(NotFoundError):
        other._download(artifact.download_url, tmp_path / "stolen")
    assert not (tmp_path / "stolen").exists() or not any((tmp_path / "stolen").iterdir())
    unknown = artifact.download_url.replace(f"/checkpoints/{artifact.id}/", "/checkpoints/999999/")
    assert httpx.get(unknown, headers={"Authorization": f"Bearer {owner_key}"}).status_code == 404
    assert httpx.get(artifact.download_url, headers={"Authorization": f"Bearer {other_key}"}).status_code == 404
    assert httpx.get(artifact.download_url, headers={"Authorization": "Bearer sk-nope"}).status_code == 401
    assert httpx.get(artifact.download_url).status_code == 303  # a browser without a session: to the sign-in page
