"""The engine's calls in process, for tests and benchmarks: submit one call, pump ticks in this thread until it
is answered, and return its result (or raise its typed error). The runtime process never uses these.

`call` and `submit_message` take a method name and its arguments and give what the wire would (plain data), read and
written as the runtime's edges do (gpu_runtime/client/protocol.py), so tests hold the engine to the wire's shapes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any

from gpu_runtime.client.protocol import answer_message, read_call
from gpu_runtime.contract import Call, SampleChunk
from gpu_runtime.contract.calls import A
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.engine.sampling_calls import Sampling
from gpu_runtime.engine.scheduler import Scheduler
from gpu_runtime.engine.shared import TickStats
from gpu_runtime.errors import SignalError


class InProcess:
    """Mixed into Engine, which provides these four."""

    scheduler: Scheduler
    sampling: Sampling

    def submit(self, call: Call[A], reply: Callable[[A | SignalError], None],
               progress: Callable[[SampleChunk], None] | None = None, ticket: int | None = None) -> None:
        raise NotImplementedError

    def tick(self) -> TickStats:
        raise NotImplementedError

    def submit_message(self, method: str, params: Mapping[str, object], reply: Callable[[JSONObject], None],
                       progress: Callable[[JSONObject], None] | None = None) -> None:
        """`submit` as the wire speaks it: `reply` gets {"result": …} or {"error": …}, `progress` each chunk's dict."""
        try:
            call, ticket = read_call(method, params)
        except SignalError as exc:
            reply(answer_message(exc))
            return
        chunks = None if progress is None else (lambda chunk: progress(chunk.to_dict()))
        self.submit(call, lambda answer: reply(answer_message(answer)), chunks, ticket)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Submit and pump ticks in this thread until answered (in-process use: tests, benchmarks)."""
        call, ticket = read_call(method, params)
        return self.answer(call, ticket).to_dict()

    def answer(self, call: Call[A], ticket: int | None = None) -> A:
        """The typed call's result, ticks pumped in this thread until it comes (its error raised)."""
        future: Future[A | SignalError] = Future()
        self.submit(call, future.set_result, ticket=ticket)
        while not future.done():
            self.tick()
            if not future.done() and not self.scheduler.has_work() and not self.sampling.busy:
                wait([future], timeout=0.5)  # answered off the tick (a Hub upload): nothing to pump meanwhile
        answer = future.result()
        if isinstance(answer, SignalError):
            raise answer
        return answer
    # The primitives, with the contract's arguments.
    def create_run(self, run_id: str, user_id: str, base_model: str, lora: Mapping[str, object] | None = None,
                   seed: int = 0, quantization: str | None = None) -> dict[str, Any]:
        return self.call("create_run", run_id=run_id, user_id=user_id, base_model=base_model, lora=lora, seed=seed,
                         quantization=quantization)

    def forward_backward(self, run_id: str, batch: Sequence[Mapping[str, object]], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, float] | None = None, request_id: str | None = None,
                         reduction: str = "mean", return_outputs: bool = False) -> dict[str, Any]:
        return self.call("forward_backward", run_id=run_id, batch=batch, loss_fn=loss_fn,
                         loss_fn_config=loss_fn_config, request_id=request_id, reduction=reduction,
                         return_outputs=return_outputs)

    def forward(self, batch: Sequence[Mapping[str, object]], run_id: str | None = None, **params: Any) -> dict[str, Any]:
        return self.call("forward", batch=batch, run_id=run_id, **params)

    def render_datums(self, run_id: str, batch: Sequence[Mapping[str, object]], loss_fn: str = "cross_entropy") -> dict[str, Any]:
        return self.call("render_datums", run_id=run_id, batch=batch, loss_fn=loss_fn)

    def optim_step(self, run_id: str, adam: dict[str, float] | None = None,
                   request_id: str | None = None) -> dict[str, Any]:
        return self.call("optim_step", run_id=run_id, adam=adam, request_id=request_id)

    def sample(self, run_id: str, prompts: list[str] | None = None, **params: Any) -> dict[str, Any]:
        return self.call("sample", run_id=run_id, prompts=prompts, **params)

    def save_weights_for_sampler(self, run_id: str, name: str | None = None,
                                 request_id: str | None = None) -> dict[str, Any]:
        return self.call("save_weights_for_sampler", run_id=run_id, name=name, request_id=request_id)

    def tokenizer(self, base_model: str | None = None, run_id: str | None = None) -> dict[str, Any]:
        return self.call("tokenizer", base_model=base_model, run_id=run_id)

    def save_state(self, run_id: str, mode: str = "adapter") -> dict[str, Any]:
        return self.call("save_state", run_id=run_id, mode=mode)

    def load_run(self, run_id: str) -> dict[str, Any]:
        return self.call("load_run", run_id=run_id)

    def run_info(self, run_id: str) -> dict[str, Any]:
        return self.call("run_info", run_id=run_id)

    def close_run(self, run_id: str) -> dict[str, Any]:
        return self.call("close_run", run_id=run_id)

    def delete_run(self, run_id: str) -> dict[str, Any]:
        return self.call("delete_run", run_id=run_id)

    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def runtime_state(self) -> dict[str, Any]:
        return self.call("runtime_state")
