"""Published checkpoints (RestClient.publish/unpublish_checkpoint_from_tinker_path) with the real SDK: another signed-in
user reads a published one by its path (lists it, samples it, billed to themselves), never writes it, and sees nothing
of it unpublished."""

from __future__ import annotations

from typing import Any, cast

import pytest
from sqlalchemy import select

from app.db import Database
from app.tables import CallRecord, User
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import run_async

TOKENS = [1, 450, 2011, 310, 264, 1421, 29889, 13, 450, 4996]  # arbitrary ids within the tiny vocabulary
READER = "reader@example.com"


@pytest.fixture(scope="module")
def owner_rest(live_server: LiveServer, tinker_key: str) -> Any:
    import tinker

    return tinker.RestClient(base_url=live_server.url, api_key=tinker_key)  # the owner: conftest's user


@pytest.fixture(scope="module")
def reader_key(live_server: LiveServer) -> str:
    return "tml-" + live_server.new_user(READER)


@pytest.fixture(scope="module")
def reader(live_server: LiveServer, reader_key: str) -> Any:
    import tinker

    return tinker.ServiceClient(base_url=live_server.url, api_key=reader_key)


@pytest.fixture(scope="module")
def saved(service_client: Any) -> dict[str, Any]:
    """The owner's model after one step, with a sampler checkpoint and a training checkpoint."""
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=5).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:]})  # type: ignore[dict-item]  # Datum converts lists to TensorData
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return {"training": training, "sampler": training.save_weights_for_sampler("shared").result().path,
            "state": training.save_state("state").result().path}


def sample(client: Any) -> tuple[list[int], list[float]]:
    from tinker import types

    result = client.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)).result()
    (sequence,) = result.sequences
    return list(sequence.tokens), list(sequence.logprobs or [])


def reader_sample_records(server: LiveServer) -> list[tuple[str | None, str]]:
    """The reader's sample call records: (run_id, operation), from the server's database (SQLite or PostgreSQL)."""
    async def read() -> list[tuple[str | None, str]]:
        db = Database(server.settings.resolved_database_url)
        try:
            async with db.session() as session:
                rows = await session.execute(select(CallRecord.run_id, CallRecord.operation).join(
                    User, User.id == CallRecord.user_id).where(User.email == READER, CallRecord.operation == "sample"))
                return [(run_id, operation) for run_id, operation in rows]
        finally:
            await db.dispose()

    return cast(list[tuple[str | None, str]], run_async(read()))


def test_a_published_checkpoint_is_read_by_another_user_and_unpublished_is_gone(
        live_server: LiveServer, service_client: Any, owner_rest: Any, reader: Any, reader_key: str, saved: Any) -> None:
    import tinker

    rest = tinker.RestClient(base_url=live_server.url, api_key=reader_key)
    model_id = saved["training"].model_id
    # Unpublished: another user can neither list, describe nor sample it.
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(model_id).result()
    with pytest.raises(tinker.NotFoundError):
        reader.create_sampling_client(model_path=saved["sampler"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(saved["sampler"]).result()

    owner_rest.publish_checkpoint_from_tinker_path(saved["sampler"]).result()
    owner_rest.publish_checkpoint_from_tinker_path(saved["sampler"]).result()  # again: no error (the SDK retries 409s)
    listed = {c.checkpoint_id: c.public for c in owner_rest.list_checkpoints(model_id).result().checkpoints}
    assert listed == {"sampler_weights/shared": True, "weights/state": False}
    # Another user sees the published one alone, and samples it: the owner's numbers at the same seed.
    seen = rest.list_checkpoints(model_id).result().checkpoints
    assert [(c.tinker_path, c.public) for c in seen] == [(saved["sampler"], True)]
    assert rest.get_weights_info_by_tinker_path(saved["sampler"]).result().lora_rank == 4
    theirs = reader.create_sampling_client(model_path=saved["sampler"]).result()
    mine = service_client.create_sampling_client(model_path=saved["sampler"]).result()
    tokens, logprobs = sample(theirs)
    assert len(tokens) == 6
    # The same tokens; logprobs within 1e-4 (the second call may find the prompt's KV in the decode cache).
    mine_tokens, mine_logprobs = sample(mine)
    assert tokens == mine_tokens and logprobs == pytest.approx(mine_logprobs, abs=1e-4)
    assert reader_sample_records(live_server) == [(None, "sample")]  # billed to the reader, on no run of theirs

    owner_rest.unpublish_checkpoint_from_tinker_path(saved["sampler"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints(model_id).result()
    with pytest.raises(tinker.NotFoundError):
        reader.create_sampling_client(model_path=saved["sampler"]).result()
    with pytest.raises(tinker.RequestFailedError, match="not found"):
        sample(theirs)  # the sampler made while it was public reads it no more
    again_tokens, again_logprobs = sample(mine)  # its owner still does
    assert again_tokens == tokens and again_logprobs == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("write", ["delete", "unpublish", "publish", "load", "load_with_optimizer"])
def test_another_user_cannot_write_a_published_checkpoint(
        live_server: LiveServer, owner_rest: Any, reader: Any, reader_key: str, saved: Any, write: str) -> None:
    import tinker

    for path in (saved["sampler"], saved["state"]):
        owner_rest.publish_checkpoint_from_tinker_path(path).result()
    rest = tinker.RestClient(base_url=live_server.url, api_key=reader_key)
    attempts = {
        "delete": lambda: rest.delete_checkpoint_from_tinker_path(saved["sampler"]).result(),
        "unpublish": lambda: rest.unpublish_checkpoint_from_tinker_path(saved["sampler"]).result(),
        "publish": lambda: rest.publish_checkpoint_from_tinker_path(saved["sampler"]).result(),
        "load": lambda: reader.create_training_client_from_state(saved["state"]).result(),
        "load_with_optimizer": lambda: reader.create_training_client_from_state_with_optimizer(saved["state"]).result(),
    }
    # A REST write is a 404; a load fails its future (the model it would read is not found for them).
    refused = tinker.NotFoundError if write in ("delete", "unpublish", "publish") else tinker.RequestFailedError
    with pytest.raises(refused, match="not found"):
        attempts[write]()
    listed = {c.checkpoint_id: c.public for c in owner_rest.list_checkpoints(saved["training"].model_id).result()
              .checkpoints}
    assert listed == {"sampler_weights/shared": True, "weights/state": True}  # still there, still published
