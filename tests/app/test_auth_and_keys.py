"""API keys over GraphQL: required, hashed, shown once, revocable; and the typed error codes."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from app.db import Database
from app.tables import ApiKey
from tests.helpers.live_server import LiveServer, error_code

ME = "{ me { id email } }"


def test_models_lists_the_catalogue_without_a_key(live_server: LiveServer) -> None:
    body = live_server.graphql("{ models { name gpu offline parameters } }")
    assert "errors" not in body
    models = {m["name"]: m for m in body["data"]["models"]}
    assert models["tiny-llama"]["offline"] is True
    assert models["meta-llama/Llama-3.2-1B"]["gpu"] == "L40S:1"
    assert models["meta-llama/Llama-3.2-1B"]["parameters"] == 1_240_000_000


def test_missing_and_wrong_keys_are_unauthenticated(live_server: LiveServer) -> None:
    missing = live_server.graphql(ME)
    assert error_code(missing) == "UNAUTHENTICATED"
    assert "Authorization: Bearer" in missing["errors"][0]["message"]
    assert missing["data"] is None
    assert error_code(live_server.graphql(ME, key="sk-not-a-real-key")) == "UNAUTHENTICATED"


def test_create_list_and_revoke_api_key(live_server: LiveServer, key: str) -> None:
    created = live_server.graphql(
        'mutation { createApiKey(name: "laptop") { secret apiKey { id name prefix revoked } } }', key=key
    )
    assert "errors" not in created
    secret = created["data"]["createApiKey"]["secret"]
    new_key = created["data"]["createApiKey"]["apiKey"]
    assert secret.startswith("sk-") and secret.startswith(new_key["prefix"])
    assert new_key["name"] == "laptop" and new_key["revoked"] is False

    # The new key is the same user's, and the secret is not stored anywhere in the database.
    assert live_server.graphql(ME, key=secret)["data"]["me"] == live_server.graphql(ME, key=key)["data"]["me"]
    stored = _stored_key(live_server, new_key["id"])
    assert secret not in repr([getattr(stored, column) for column in ApiKey.__table__.columns.keys()])
    assert len(stored.key_hash) == 64 and secret.startswith(stored.prefix)
    listed = live_server.graphql("{ apiKeys { id prefix lastUsedAt } }", key=key)["data"]["apiKeys"]
    assert {k["id"] for k in listed} >= {new_key["id"]}
    assert next(k for k in listed if k["id"] == new_key["id"])["lastUsedAt"] is not None

    revoked = live_server.graphql(f'mutation {{ revokeApiKey(id: "{new_key["id"]}") {{ revoked revokedAt }} }}',
                                  key=key)
    assert revoked["data"]["revokeApiKey"]["revoked"] is True
    assert error_code(live_server.graphql(ME, key=secret)) == "UNAUTHENTICATED"
    assert "errors" not in live_server.graphql(ME, key=key)


def test_one_user_cannot_revoke_anothers_key(live_server: LiveServer, key: str) -> None:
    other = live_server.new_user()
    other_key_id = live_server.graphql("{ apiKeys { id } }", key=other)["data"]["apiKeys"][0]["id"]
    body = live_server.graphql(f'mutation {{ revokeApiKey(id: "{other_key_id}") {{ id }} }}', key=key)
    assert error_code(body) == "NOT_FOUND"
    assert "errors" not in live_server.graphql(ME, key=other)
    assert all(k["id"] != other_key_id for k in live_server.graphql("{ apiKeys { id } }", key=key)["data"]["apiKeys"])
    # An id no key could have (PostgreSQL refuses NUL in a parameter) is NOT_FOUND too, never INTERNAL.
    nul = live_server.graphql("mutation($id: ID!) { revokeApiKey(id: $id) { id } }", {"id": "k\x00"}, key=key)
    assert error_code(nul) == "NOT_FOUND", nul


def test_query_limits_refuse_deep_and_aliased_documents(live_server: LiveServer, key: str) -> None:
    aliases = " ".join(f"m{i}: models {{ name }}" for i in range(30))
    body = live_server.graphql(f"{{ {aliases} }}", key=key)
    assert body["errors"] and "aliases" in body["errors"][0]["message"].lower()
    broken = live_server.graphql("{ models { name ", key=key)
    assert error_code(broken) == "GRAPHQL_VALIDATION_FAILED"


def _stored_key(live_server: LiveServer, key_id: str) -> ApiKey:
    async def load() -> ApiKey:
        db = Database(live_server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                return (await session.scalars(select(ApiKey).where(ApiKey.id == key_id))).one()
        finally:
            await db.dispose()

    return asyncio.run(load())


def test_graphiql_and_healthz_are_served(live_server: LiveServer) -> None:
    import httpx

    page = httpx.get(f"{live_server.url}/graphql", headers={"Accept": "text/html"}, timeout=30)
    assert page.status_code == 200 and "graphiql" in page.text.lower()
    health = httpx.get(f"{live_server.url}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_oversized_request_bodies_are_refused_before_parsing(live_server: LiveServer, key: str) -> None:
    import httpx

    from rewardsignal import PayloadTooLargeError, SignalClient

    too_big = "x" * (live_server.settings.max_request_bytes + 1)
    # A declared Content-Length over the limit: Starlette answers 413 itself (in text) before reading the body.
    response = httpx.post(f"{live_server.url}/graphql", content=too_big, timeout=60,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert response.status_code == 413
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4)
    with pytest.raises(PayloadTooLargeError) as refused:  # the SDK still names it by its code
        run.forward_backward(batch=[{"text": too_big}])
    assert refused.value.code == "PAYLOAD_TOO_LARGE"

    def chunks():  # no Content-Length: the streamed bytes are counted
        for _ in range(live_server.settings.max_request_bytes // 65536 + 2):
            yield b"x" * 65536

    streamed = httpx.post(f"{live_server.url}/graphql", content=chunks(), timeout=60,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert streamed.status_code == 413
    assert streamed.json()["errors"][0]["extensions"]["code"] == "PAYLOAD_TOO_LARGE"
    assert "errors" not in live_server.graphql("{ me { id } }", key=key)
