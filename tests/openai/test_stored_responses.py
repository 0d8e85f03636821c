"""/v1/responses' stored responses in the database (app/services/stored_responses.py): `previous_response_id` after a
server restart (and with the ids the model saw and wrote, token-exact), gone with its run, bounded per user and each
user's own."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import openai
import pytest

from app.db import Database, migrate_async
from app.services.stored_responses import RESPONSES_PER_USER, StoredResponses
from app.services.users import UserService
from app.settings import Settings
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, settings_for

pytestmark = pytest.mark.timeout(600)


def _v1(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{server.url}/v1", max_retries=0)


@pytest.fixture(scope="module")
def settings(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return settings_for(tmp_path_factory.mktemp("stored-responses"), tiny_model_dir)


@pytest.fixture(scope="module")
def restarted(settings: Settings) -> Iterator[tuple[LiveServer, str, openai.types.responses.Response]]:
    """A response answered by one server, then that server stopped and another started on its data directory."""
    first = LiveServer.start(settings)
    try:
        key = first.new_user()
        response = _v1(first, key).responses.create(model="tiny-llama", input="Hello there", max_output_tokens=4,
                                                    temperature=0)
    finally:
        first.stop()
    second = LiveServer.start(settings.model_copy(update={"port": settings.port}))
    yield second, key, response
    second.stop()


def test_a_response_is_continued_after_a_restart_from_the_ids_it_sampled(
        restarted: tuple[LiveServer, str, openai.types.responses.Response]) -> None:
    server, key, first = restarted
    second = _v1(server, key).responses.create(model="tiny-llama", previous_response_id=first.id, input="And then?",
                                               max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    seen, wrote = (first.model_extra or {})["prompt_token_ids"], (first.model_extra or {})["output_token_ids"]
    history = (second.model_extra or {})["prompt_token_ids"]
    assert history[:len(seen) + len(wrote)] == seen + wrote  # the first turn as sampled, not re-rendered
    assert len(history) > len(seen) + len(wrote)  # then the template's end of that turn and the new user turn


def test_another_users_response_is_not_found_after_the_restart_too(
        restarted: tuple[LiveServer, str, openai.types.responses.Response]) -> None:
    server, _, first = restarted
    with pytest.raises(openai.NotFoundError) as caught:
        _v1(server, server.new_user()).responses.create(model="tiny-llama", previous_response_id=first.id, input="Hi",
                                                        max_output_tokens=2)
    assert json.loads(caught.value.response.text)["error"]["param"] == "previous_response_id"


def test_a_response_on_a_deleted_run_cannot_be_continued(
        restarted: tuple[LiveServer, str, openai.types.responses.Response]) -> None:
    server, key, _ = restarted
    run = SignalClient(api_key=key, base_url=server.url).create_run(lora_r=4, seed=1)
    v1 = _v1(server, key)
    kept = v1.responses.create(model=run.id, input="Hi", max_output_tokens=2)
    assert v1.responses.create(model=run.id, previous_response_id=kept.id, input="Again", max_output_tokens=2).id
    run.delete()
    with pytest.raises(openai.NotFoundError) as caught:
        v1.responses.create(model="tiny-llama", previous_response_id=kept.id, input="Again", max_output_tokens=2)
    assert json.loads(caught.value.response.text)["error"]["code"] == "previous_response_not_found"


async def test_each_user_keeps_the_newest_responses_up_to_the_bound(settings: Settings) -> None:
    url = settings.resolved_database_url  # the module's database (SQLite, or PostgreSQL's with SIGNAL_TEST_DATABASE)
    await migrate_async(url)
    db = Database(url)
    try:
        users = UserService(db)
        a, _ = await users.get_or_create(f"a-{uuid.uuid4().hex[:8]}@example.com")
        b, _ = await users.get_or_create(f"b-{uuid.uuid4().hex[:8]}@example.com")
        store = StoredResponses(db, ttl_s=3600)
        theirs = f"resp_{uuid.uuid4().hex}"
        await store.keep(b, theirs, None, [{"role": "user", "content": "b's"}])
        mine = [f"resp_{uuid.uuid4().hex}" for _ in range(RESPONSES_PER_USER + 1)]
        for n, ident in enumerate(mine):
            await store.keep(a, ident, None, [{"role": "user", "content": str(n)}])
        assert await store.get(a, mine[0]) is None  # the oldest went
        assert await store.get(a, mine[1]) == [{"role": "user", "content": "1"}]
        assert await store.get(a, mine[-1]) == [{"role": "user", "content": str(RESPONSES_PER_USER)}]
        assert await store.get(b, theirs) == [{"role": "user", "content": "b's"}]  # a's bound is a's alone
        assert await store.get(a, theirs) is None and await store.get(b, mine[-1]) is None
        assert await store.get(a, "resp_\x00") is None
    finally:
        await db.dispose()


async def test_an_expired_response_is_not_found(settings: Settings) -> None:
    url = settings.resolved_database_url
    await migrate_async(url)
    db = Database(url)
    try:
        user, _ = await UserService(db).get_or_create(f"c-{uuid.uuid4().hex[:8]}@example.com")
        store = StoredResponses(db, ttl_s=-1)  # expired as soon as it is kept
        await store.keep(user, "resp_expired", None, [{"role": "user", "content": "x"}])
        assert await store.get(user, "resp_expired") is None
    finally:
        await db.dispose()
