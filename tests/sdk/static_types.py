"""The types users see on both clients, pinned for mypy (pyproject's `files` takes in tests/): a method written once
on the shared bases answers its result on SignalClient and Run, a coroutine of it on AsyncSignalClient and AsyncRun.
Nothing here is called; an answer's type changing fails `mypy`."""

from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, assert_type

from rewardsignal import Artifact, AsyncRun, AsyncSignalClient, Run, SignalClient
from rewardsignal.results import ForwardBackwardResult, ModelInfo, SampleResult, TokenizerResult, UserResult


def blocking(client: SignalClient) -> None:
    run = client.create_run(lora_r=8)
    assert_type(run, Run)
    assert_type(client.get_run("run-id"), Run)
    assert_type(client.list_runs(), list[Run])
    assert_type(client.me(), UserResult)
    assert_type(client.list_models(), list[str])
    assert_type(client.list_models(detailed=True), list[ModelInfo])
    assert_type(client.sample_base("hi"), SampleResult)
    assert_type(run.forward_backward([{"text": "hi"}]), ForwardBackwardResult)
    assert_type(run.update(name="renamed"), Run)
    assert_type(run.tokenizer(), TokenizerResult)
    assert_type(run.save_state(), Artifact)
    assert_type(run.checkpoints(), list[Artifact])
    assert_type(run.sample_async("hi"), Future[SampleResult])


async def awaiting(client: AsyncSignalClient) -> None:
    pending = client.create_run(lora_r=8)
    _ = assert_type(pending, Coroutine[Any, Any, AsyncRun])  # `_ =`: an unused coroutine is an error of its own
    run = await pending
    assert_type(run, AsyncRun)
    assert_type(await client.get_run("run-id"), AsyncRun)
    assert_type(await client.list_runs(), list[AsyncRun])
    assert_type(await client.me(), UserResult)
    assert_type(await client.list_models(), list[str])
    assert_type(await client.list_models(detailed=True), list[ModelInfo])
    assert_type(await run.forward_backward([{"text": "hi"}]), ForwardBackwardResult)
    assert_type(await run.update(name="renamed"), AsyncRun)
    assert_type(await run.refresh(), AsyncRun)
    assert_type(await run.tokenizer(), TokenizerResult)
    assert_type(await run.save_state(), Artifact)
    assert_type(await run.checkpoints(), list[Artifact])
