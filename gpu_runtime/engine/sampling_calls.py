"""sample on resident runs: check the prompts against the model, then decode on the base's engine, chunk by chunk.

A picked sample call becomes a `SampleJob` and joins its base's decoder (gpu_runtime/compute/decoding.py: one decode
engine per base, continuous batching, whenever the call arrives), which steps by a time-bounded share of a chunk per
tick, so other calls interleave with a long generation. Its weights come from gpu_runtime/engine/weights_sources.py:
a sample on a run's current weights holds its run until it finishes; one on a snapshot, a copy of the latest weights
or a base holds nothing but its snapshot (in use: never evicted). Within a base, users share the engine's slots
(the decoder admits the fewest-rows user first); across bases, each user decoding has an equal share of a tick's
chunk (`_shares`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any, cast

from gpu_runtime.compute.decode.engine import Handle
from gpu_runtime.compute.decoding import BaseDecoder, SampleJob
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.contract import (
    Cancel,
    RenderChat,
    RenderChatResult,
    Sample,
    SampleChunk,
    SampleResult,
    SequenceChunk,
    Tokenizer,
    TokenizerResult,
    check_sample_size,
)
from gpu_runtime.engine.chat_tools import render_messages, template_of, tool_format
from gpu_runtime.engine.detokenize import IncrementalText
from gpu_runtime.engine.request import Request
from gpu_runtime.engine.run_state import REMEMBERED_SAMPLES, RunState, check_same_body
from gpu_runtime.engine.scheduler import cancel_error
from gpu_runtime.engine.shared import Shared, TickStats, internal
from gpu_runtime.engine.snapshots import Snapshots
from gpu_runtime.engine.weights_sources import WeightsSource
from gpu_runtime.errors import BadInput, SignalError

log = logging.getLogger("gpu_runtime.compute.sampling")


class Sampling:
    def __init__(self, shared: Shared, snapshots: Snapshots) -> None:
        self.shared = shared
        self.snapshots = snapshots
        self.decoders: dict[int, BaseDecoder] = {}  # each base's (by id of its entry) decode engine and calls
        # Answers of frozen samples by (run or user, request id), each with its call's body hash: memory only, like
        # a run's `sampled`.
        self.answers: OrderedDict[tuple[str, str], tuple[str, dict[str, object]]] = OrderedDict()

    def replayed(self, call: Sample) -> SampleResult | None:
        """A retry whose first answer may not have reached the caller: that answer again."""
        if not call.request_id:
            return None
        body = call.body_sha256()
        previous: dict[str, Any] | None = None
        remembered = self.answers.get(_answer_key(call))  # frozen weights' answers (a queued `latest` sample's: below)
        if remembered is not None:
            check_same_body(call.request_id, remembered[0], body)
            previous = remembered[1]
        elif not call.frozen or call.latest:
            state = self.shared.residency.runs.get(call.run_id or "")
            previous = state.answer_to(call.request_id, body, sampled=True) if state is not None else None
        return None if previous is None else SampleResult.from_dict(previous).replay()

    def prepare(self, request: Request, source: WeightsSource, call: Sample) -> SampleJob:
        prompts, settings = call.settings()
        entry = source.entry
        limit, vocab = entry.renderer.max_length, entry.renderer.vocab_size
        field = call.prompts_field
        prompt_ids = prompt_ids_of(call, prompts, entry)
        for i, ids in enumerate(prompt_ids):
            if call.messages is not None and len(ids) >= limit:  # /v1's own words for a chat too long
                raise BadInput(f"the prompt is {len(ids)} tokens; the model's context is {limit}", field=field)
            if not ids or len(ids) >= limit:
                raise BadInput(f"{field}[{i}] is {len(ids)} tokens; the model's context is {limit}", field=f"{field}[{i}]")
        if call.fit_context:  # max_tokens not given: the room the longest prompt leaves
            settings = replace(settings, max_tokens=min(settings.max_tokens, limit - max(map(len, prompt_ids))))
        for i, ids in enumerate(prompt_ids):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise BadInput(f"{field}[{i}] has token id {outside[0]} outside the vocabulary (0..{vocab - 1})",
                               field=f"{field}[{i}]")
            if len(ids) + settings.max_tokens > limit:
                raise BadInput(f"{field}[{i}] ({len(ids)} tokens) + max_tokens ({settings.max_tokens}) exceeds "
                               f"the context ({limit})", field="max_tokens")
        check_sample_size(len(prompt_ids), settings, self.shared.options, field, [len(ids) for ids in prompt_ids])
        outside = [t for t in settings.stop_tokens if t >= vocab]
        if outside:
            raise BadInput(f"stop token id {outside[0]} is outside the vocabulary (0..{vocab - 1})", field="stop")
        version = source.state.weights_version if source.state is not None else \
            source.snapshot.weights_version if source.snapshot is not None else 0
        job = SampleJob(request, source.state, prompt_ids, settings, step=source.step, key=source.key,
                        routed=source.routing_key is not None, snapshot=source.snapshot, weights=version)
        if not self._decoder(entry).fits(job):
            raise BadInput(f"num_samples {settings.num_samples} sequences of {max(map(len, prompt_ids))} prompt tokens "
                           f"+ max_tokens {settings.max_tokens} pass this device's decode cache: ask fewer samples or "
                           "tokens", field="num_samples")
        return job

    def _decoder(self, entry: BaseEntry) -> BaseDecoder:
        decoder = self.decoders.get(id(entry))
        if decoder is None or decoder.entry is not entry:
            decoder = BaseDecoder(entry, eos_ids(entry), self.shared.options.tick_tokens)
            self.decoders[id(entry)] = decoder
        return decoder

    def tokenizer(self, call: Tokenizer, state: RunState | None) -> TokenizerResult:
        """The tokenizer of `state`'s base (a run's), else of `call.base_model` (loaded if it is not)."""
        entry = self.shared.entry(state) if state is not None else \
            self.shared.residency.base(str(call.base_model), call.quantization)
        tokenizer = entry.base.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        directory = self._saved_tokenizer(entry) if call.save else None
        return TokenizerResult(name=entry.base.name, vocab_size=entry.renderer.vocab_size,
                               eos_token_ids=sorted(eos_ids(entry)), bos_token_id=tokenizer.bos_token_id,
                               pad_token_id=tokenizer.pad_token_id,
                               chat_template=template if isinstance(template, str) else None, directory=directory)

    def _saved_tokenizer(self, entry: BaseEntry) -> str:
        """The base's tokenizer under data_dir/tokenizers/<digest of its name>, written once: into a temporary
        directory, then renamed, so a reader never sees half of it."""
        directory = self.shared.data_dir / "tokenizers" / hashlib.sha256(entry.base.name.encode()).hexdigest()[:16]
        if not directory.is_dir():
            partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            entry.base.tokenizer.save_pretrained(str(partial))
            partial.replace(directory)
        return str(directory)

    def render_chat(self, call: RenderChat, state: RunState | None) -> RenderChatResult:
        """In the tick: the base loaded (a run's restored) if it is not."""
        entry = self.shared.entry(state) if state is not None else self.shared.residency.base(str(call.base_model), None)
        return render_chat(call, entry, entry.base.tokenizer)

    def start(self, entry: BaseEntry, jobs: list[SampleJob]) -> None:
        for job in jobs:
            if job.state is not None:  # the run's current weights: nothing else on the run until it is done
                assert job.request.run_id is not None
                self.shared.scheduler.hold(job.request.run_id)
                self.shared.residency.touch(job.state)
            if job.snapshot is not None:
                self.snapshots.acquire(job.snapshot)
        decoder = self._decoder(entry)
        for job in jobs:
            decoder.start(job)

    def stop(self, call: Cancel) -> bool:
        """Stop the sample `call` names if it is decoding (False: it is not): its client gone, it is answered with
        what it has (stop_reason "cancelled"); withdrawn (`withdraw`, CANCELLED) or its deadline passed
        (DEADLINE_EXCEEDED): never applied, not kept for a retry, with the compute seconds it used."""
        for decoder in self.decoders.values():
            for job in decoder.jobs:
                request = job.request
                if not job.done and request.request_id == call.request_id and request.user_id == call.user_id:
                    decoder.stop(job)
                    self._release(job)
                    answer: SampleResult | SignalError
                    if call.deadline or call.withdraw:  # withdrawn: never applied, not kept for a retry
                        answer = cancel_error(call.deadline, job.compute_seconds)
                    else:
                        answer = self._finished(decoder, job)
                    self.shared.scheduler.finish(request, answer)
                    return True
        return False

    def advance(self, stats: TickStats, trained: float = 0.0) -> None:
        """Every base's decoder by its share of one chunk (`_shares`), the fewest rows first (the time one leaves is
        the next ones'); finished calls are answered as they finish, a failing engine fails its calls alone.

        The chunk lasts `decode_chunk_seconds`, or as long as the tick's training took (`trained`) if that was
        longer: a tick time-shares sampling and training, so neither gets less than half the device while both wait."""
        for decoder in self.decoders.values():
            for job in decoder.jobs:
                if not job.done and not job.parked and job.handles and _held(self.shared.faults, job.request):
                    decoder.park(job)  # failpoint: a sample that never ends (after its first chunk) until cancelled
        bases = [id(entry) for entry in self.shared.residency.bases.values()]
        for key in [key for key, d in self.decoders.items() if not d.jobs and key not in bases]:
            del self.decoders[key]  # its base was unloaded: its engine and cache go with it
        shares = self._shares()
        end = time.monotonic() + max(self.shared.options.decode_chunk_seconds, trained)
        order = sorted((d for d in self.decoders.values() if d.busy), key=lambda d: sum(j.live for j in d.jobs))
        for i, decoder in enumerate(order):
            engine = decoder.engine
            before, now = engine.passes if engine is not None else 0, time.monotonic()
            left = sum(shares[id(later)] for later in order[i:])
            deadline = now + max(end - now, 0.0) * shares[id(decoder)] / left if left > 0 else now
            if not self._advance(decoder, deadline):
                continue
            engine = decoder.engine
            if engine is not None:
                stats.decode_passes += engine.passes - before
                stats.decode_rows += len(engine.by_slot)
            decoder.entry.idle_since = time.monotonic()  # a base being decoded on is not idle
            for job in list(decoder.jobs):
                if not job.done and job.request.progress is not None:
                    self._stream(decoder, job)

    def _advance(self, decoder: BaseDecoder, deadline: float) -> bool:
        """Decode until `deadline` (one step at least), answering each call as it finishes. False: the engine
        failed, and its calls with it."""
        while True:
            try:
                finished = decoder.advance(deadline, self.shared.compute.seconds_since)
            except Exception as exc:  # noqa: BLE001 - fail its calls, keep the runtime
                active = [job for job in decoder.jobs if not job.done]
                error = exc if isinstance(exc, SignalError) else internal(exc, active[0].request if active else None)
                self.fail_all(error, [decoder])
                return False
            for job in finished:
                result = self._finished(decoder, job)
                self._release(job)
                self.shared.scheduler.finish(job.request, result)
            if not decoder.busy or time.monotonic() >= deadline:
                return True

    def _shares(self) -> dict[int, float]:
        """Each base's share of this tick's chunk: every user decoding has an equal share, split over the bases they
        decode on by their rows there. A base past its share still decodes a step (none starves)."""
        rows: dict[str, int] = {}
        for decoder in self.decoders.values():
            for job in decoder.jobs:
                if not job.done and not job.parked:
                    rows[job.request.user_id] = rows.get(job.request.user_id, 0) + job.rows
        share = 1 / max(len(rows), 1)
        return {id(decoder): sum(share * job.rows / rows[job.request.user_id]
                                 for job in decoder.jobs if not job.done and not job.parked)
                for decoder in self.decoders.values()}

    def _stream(self, decoder: BaseDecoder, job: SampleJob) -> None:
        """A streamed job's progress after a chunk: each sequence's newly settled text and ids (none once finished)."""
        tokenizer = decoder.entry.base.tokenizer
        n = job.settings.num_samples
        if not job.streams:
            stops = job.settings.stop

            def decode(ids: list[int]) -> str:
                return cast(str, tokenizer.decode(ids, skip_special_tokens=True))  # one sequence in, one str out

            job.streams = [IncrementalText(decode, stops) for _ in range(job.rows)]
        opening = not any(stream.ids for stream in job.streams)  # nothing sent yet: the first chunk names the prompts
        handles: list[Handle | None] = []
        for prompt_handles in job.sequences():  # a prompt not yet in the engine: nothing of its samples yet
            handles += prompt_handles or [None] * n
        rows: list[SequenceChunk] = []
        for handle, stream in zip(handles, job.streams):
            if handle is None or handle.done:
                rows.append({"text": "", "tokens": [], "logprobs": []})
                continue
            start = stream.ids
            text, count = stream.step(handle.tokens)
            rows.append({"text": text, "tokens": handle.tokens[start:start + count],
                         "logprobs": handle.logprobs[start:start + count]})
        if any(row["text"] or row["tokens"] for row in rows):
            chunk = SampleChunk(sequences=[rows[p * n:(p + 1) * n] for p in range(len(job.prompt_ids))],
                                prompt_tokens=job.prompt_ids if opening else None)
            assert job.request.progress is not None
            job.request.progress(chunk)

    def fail_all(self, error: SignalError, decoders: list[BaseDecoder] | None = None) -> None:
        """Fail every call still decoding on `decoders` (all of them: a rank failed); their engines go."""
        for decoder in list(self.decoders.values() if decoders is None else decoders):
            for job in decoder.fail():
                self._release(job)
                self.shared.scheduler.finish(job.request, error)

    def failing_runs(self, run_ids: set[str]) -> list[BaseDecoder]:
        """The decoders with a call reading one of `run_ids`' adapters (which leave memory)."""
        return [d for d in self.decoders.values() if any(r in run_ids for r in d.run_ids)]

    @property
    def busy(self) -> bool:
        return any(decoder.busy or decoder.jobs for decoder in self.decoders.values())

    def describe(self) -> list[dict[str, Any]]:
        """Each base's decoding, for the operator's view."""
        return [{"runs": d.run_ids, "calls": sum(not j.done for j in d.jobs),
                 "rows": len(d.engine.by_slot) if d.engine is not None else 0,
                 "slots": d.engine.cache.count if d.engine is not None else 0,
                 "steps": d.engine.steps if d.engine is not None else 0,
                 "tokens_done": max((len(h.tokens) for h in d.engine.by_slot.values()), default=0)
                 if d.engine is not None else 0}
                for d in self.decoders.values() if d.jobs]

    def _finished(self, decoder: BaseDecoder, job: SampleJob) -> SampleResult:
        """A job's answer, remembered for a retry."""
        result = {**decoder.result(job), "compute_seconds": job.compute_seconds}
        result.update(rendered_extras(cast(Sample, job.request.call), decoder.entry, result))
        self._remember(job, result)
        return SampleResult.from_dict(result)

    def _remember(self, job: SampleJob, result: dict[str, object]) -> None:
        body = job.request.call.body_sha256()
        if job.state is not None:
            job.state.remember_sample(job.request.request_id, result, body)
        elif job.request.request_id:
            self.answers[_answer_key(job.request.call)] = (body, result)
            while len(self.answers) > REMEMBERED_SAMPLES:
                self.answers.popitem(last=False)

    def _release(self, job: SampleJob) -> None:
        if job.snapshot is not None:
            self.snapshots.release(job.snapshot)
            job.snapshot = None

    @property
    def decoding_runs(self) -> set[str]:
        return {run_id for decoder in self.decoders.values() for run_id in decoder.run_ids}


def _answer_key(call: Sample) -> tuple[str, str]:
    return (call.run_id or f"user:{call.user_id}", call.request_id or "")


def prompt_ids_of(call: Sample, prompts: list[str] | list[list[int]], entry: BaseEntry) -> list[list[int]]:
    """A sample's prompts as ids: its messages rendered as render_chat renders them, text tokenised, ids as given."""
    tokenizer = entry.base.tokenizer
    if call.messages is not None:
        check_text_fits(None, call.messages, tokenizer, entry.renderer.max_length)
        history = None if call.history_tokens is None else (call.history_tokens, int(call.history_through or 0))
        return [render_messages(tokenizer, call.messages, call.tools, call.prefill, history)]
    return [list(tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else list(p)
            for p in prompts]


def rendered_extras(call: Sample, entry: BaseEntry, result: dict[str, Any]) -> dict[str, object]:
    """What a sample's result adds for a client without a tokenizer (/v1): with messages the EOS ids and the template's
    call format; with `pieces` the text of the ids it names (as /v1's answer would have asked render_chat for)."""
    extras: dict[str, object] = {}
    eos = eos_ids(entry)
    if call.messages is not None:
        tokenizer = entry.base.tokenizer
        extras.update(eos_token_ids=sorted(eos), tool_format=tool_format(template_of(tokenizer, bool(call.tools))))
    if call.pieces is None:
        return extras
    sequences = cast("list[list[dict[str, Any]]]", result["sequences"])  # decoder.result's dicts
    if call.pieces == "stopped":  # only a sequence cut at a stop string needs its tokens' text (answers.kept)
        wanted = {t for row in sequences for s in row if s.get("stop_reason") == "stop" and s["tokens"]
                  and s["tokens"][-1] not in eos for t in s["tokens"]}
    else:
        wanted = {t for row in sequences for s in row for t in s["tokens"]}
        wanted |= {t for ids in cast("list[list[int]]", result["prompt_tokens"]) for t in ids}
        wanted |= {int(pair[0]) for row in sequences for s in row for top in s.get("topk_logprobs") or []
                   for pair in top}
        wanted |= {int(pair[0]) for tops in cast("list[list[Any]]", result.get("topk_prompt_logprobs") or [])
                   for top in tops if top for pair in top}
    order = sorted(wanted)
    extras.update(piece_ids=order, pieces=decode_pieces(entry.base.tokenizer, order, entry.renderer.vocab_size))
    return extras


def decode_pieces(tokenizer: Any, ids: list[int], vocab: int) -> list[str]:
    """Each id's text alone (special tokens as ""; an id past the vocabulary as "")."""
    return [cast(str, tokenizer.decode([t], skip_special_tokens=True)) if t < vocab else "" for t in ids]


def render_chat(call: RenderChat, entry: BaseEntry, tokenizer: Any) -> RenderChatResult:
    """Messages through the chat template as ids (tokenize=True: the template's own BOS, once), ids as text, with
    `tokenizer`: the base's in the tick, a copy of it off the tick (gpu_runtime/engine/off_tick.py)."""
    ids = None
    check_text_fits(call.prompts, call.messages, tokenizer, entry.renderer.max_length)
    if call.messages is not None:
        history = None if call.history_tokens is None else (call.history_tokens, int(call.history_through or 0))
        ids = render_messages(tokenizer, call.messages, call.tools, call.prefill, history)
    texts = None if call.prompts is None else [list(tokenizer(p, add_special_tokens=True)["input_ids"])
                                                for p in call.prompts]  # as prepare() tokenises a text prompt
    pieces = decode_pieces(tokenizer, call.decode or [], entry.renderer.vocab_size)
    return RenderChatResult(prompt_tokens=ids, prompts_tokens=texts, pieces=pieces, context_length=entry.renderer.max_length,
                            eos_token_ids=sorted(eos_ids(entry)),
                            tool_format=tool_format(template_of(tokenizer, bool(call.tools))))


def eos_ids(entry: BaseEntry) -> set[int]:
    ids = {entry.base.tokenizer.eos_token_id}
    configured = getattr(entry.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _held(faults: set[str], request: Request) -> bool:
    """The failpoints hold_decode (a sample whose request id starts with "hold"), hold_streams (any streamed sample)
    and hold_v1 (any /v1 sample): such a sample stops after its first chunk until it is cancelled (tests/faults)."""
    request_id = request.request_id or ""
    return (("hold_decode" in faults and request_id.startswith("hold"))
            or ("hold_streams" in faults and request.progress is not None)
            or ("hold_v1" in faults and request_id.startswith("v1-")))


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes of text one token stands for: its vocabulary string's UTF-8 length (a byte-level
    BPE's one character per byte, SentencePiece's 3-byte word marker for one space, a byte token's <0xNN>)."""
    cached = getattr(tokenizer, "_signal_longest_token_bytes", None)
    if cached is None:
        cached = max((len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1)
        tokenizer._signal_longest_token_bytes = cached
    return int(cached)


def check_text_fits(prompts: list[str] | None, messages: list[dict[str, Any]] | None, tokenizer: Any,
                    context_length: int) -> None:
    """Refuse text that cannot fit the context before tokenizing it: past context x the longest token's bytes it
    is more tokens than the context holds, whatever they are (a 6 MB prompt took seconds of this thread)."""
    bound = context_length * longest_token_bytes(tokenizer)
    for i, prompt in enumerate(prompts or []):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise BadInput(f"prompt {i} is {size} bytes: more than the {context_length} tokens of the model's context "
                           f"can hold (at most {bound} bytes)", field="prompt")
    size = sum(len(str(m.get("content") or "").encode("utf-8", "surrogatepass")) for m in messages or [])
    if size > bound:
        raise BadInput(f"the messages are {size} bytes: more than the {context_length} tokens of the model's "
                       f"context can hold (at most {bound} bytes)", field="messages")
