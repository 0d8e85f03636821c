"""sample on resident runs: check the prompts against the model, then decode in groups, chunk by chunk.

A picked sample call becomes a `SampleJob`; the calls picked in one tick on one base form decode groups
(gpu_runtime/compute/decoding.py; users of like size together), each advancing by a time-bounded share of a chunk
per tick, so other calls interleave with a long generation. Its weights come from gpu_runtime/engine/weights_sources.py:
a sample on a run's current weights holds its run until it finishes; one on a snapshot, a copy of the latest weights
or a base holds nothing but its snapshot (in use: never evicted). A group that starts while another on its base decodes joins one it may share with
(`may_share`) after its first chunk (`_merge`); each user decoding has an equal share of a tick's chunk (`_shares`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import OrderedDict
from typing import Any, cast

import torch

from gpu_runtime.compute.decoding import DecodeGroup, PrefillRate, SampleJob, may_share
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
        self.groups: list[DecodeGroup] = []
        self.prefill_rates: dict[int, PrefillRate] = {}  # each base's (by id of its entry) prefill speed
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
        field = "prompts" if call.prompt_tokens is None else "prompt_tokens"
        prompt_ids = [list(entry.base.tokenizer(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str)
                      else list(p) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) >= limit:
                raise BadInput(f"{field}[{i}] is {len(ids)} tokens; the model's context is {limit}", field=f"{field}[{i}]")
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
        generator = torch.Generator(device=self.shared.device).manual_seed(settings.seed)
        return SampleJob(request, source.state, prompt_ids, settings, generator, step=source.step, key=source.key,
                         snapshot=source.snapshot)

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
        for part in _partition(jobs, next(entry.model.parameters()).device):
            rate = self.prefill_rates.setdefault(id(entry), PrefillRate())
            self.groups.append(DecodeGroup(entry, part, eos_ids(entry), self.shared.options.tick_tokens, rate))

    def stop(self, call: Cancel) -> bool:
        """Stop the sample `call` names if it is decoding (False: it is not): its client gone, it is answered with
        what it has (stop_reason "cancelled"); withdrawn (`withdraw`, CANCELLED) or its deadline passed
        (DEADLINE_EXCEEDED): never applied, not kept for a retry, with the compute seconds it used."""
        for group in list(self.groups):
            for job in group.jobs:
                request = job.request
                if not job.done and request.request_id == call.request_id and request.user_id == call.user_id:
                    job.done = True
                    self._release(job)
                    answer: SampleResult | SignalError
                    if call.deadline or call.withdraw:  # withdrawn: never applied, not kept for a retry
                        answer = cancel_error(call.deadline, job.compute_seconds)
                    else:
                        job.reasons = [reason or "cancelled" for reason in job.reasons]
                        answer = self._finished(group, job)
                    self.shared.scheduler.finish(request, answer)
                    if group.done:
                        self.groups.remove(group)
                    return True
        return False

    def advance(self, stats: TickStats, trained: float = 0.0) -> None:
        """Every decode group by one chunk, shared fairly by the users decoding (`_shares`), the fewest rows first
        (the time a group leaves is the next ones'); finished calls are answered as they finish, a failing group fails
        its calls alone. A new group decodes its share too, then joins its like (`_merge`).

        The chunk lasts `decode_chunk_seconds`, or as long as the tick's training took (`trained`) if that was
        longer: a tick time-shares sampling and training, so neither gets less than half the device while both wait."""
        shares = self._shares()
        end = time.monotonic() + max(self.shared.options.decode_chunk_seconds, trained)
        order = sorted(self.groups, key=lambda group: group.live_rows)
        for i, group in enumerate(order):
            if group.passes and any(_held(self.shared.faults, job.request) for job in group.jobs):
                continue  # failpoint: a sample that never ends (after its first chunk) until it is cancelled
            before, now = group.passes, time.monotonic()
            left = sum(shares[id(later)] for later in order[i:])
            deadline = now + max(end - now, 0.0) * shares[id(group)] / left if left > 0 else now
            if not self._advance(group, deadline):
                continue
            stats.decode_passes += group.passes - before
            stats.decode_rows += group.rows
            group.entry.idle_since = time.monotonic()  # a base being decoded on is not idle
            for job in group.jobs:
                if not job.done and job.request.progress is not None:
                    self._stream(group, job)
            if group.done:
                self.groups.remove(group)
        self._merge()

    def _advance(self, group: DecodeGroup, deadline: float) -> bool:
        """Decode `group` until `deadline` (one token at least), answering each call as it finishes. False: the group
        failed, and its calls with it."""
        while True:
            active = [job for job in group.jobs if not job.done]
            started = time.perf_counter()
            try:
                finished = group.advance(deadline)
            except Exception as exc:  # noqa: BLE001 - fail its calls, keep the runtime
                error = exc if isinstance(exc, SignalError) else internal(exc, active[0].request if active else None)
                self.fail_all(error, [group])
                return False
            seconds, rows = self.shared.compute.seconds_since(started), sum(job.end - job.start for job in active)
            for job in active:  # the seconds, shared by the rows of the calls still decoding
                job.compute_seconds += seconds * (job.end - job.start) / max(rows, 1)
            for job in finished:
                result = self._finished(group, job)
                self._release(job)
                self.shared.scheduler.finish(job.request, result)
            if group.done or time.monotonic() >= deadline:
                return True

    def _shares(self) -> dict[int, float]:
        """Each decode group's share of this tick's chunk: every user decoding has an equal share, split over their
        groups by their rows, so a user with many rows (in a group of their own, `may_share`) takes no more of the
        chunk than a user with one. A group past its share still decodes a token (none starves)."""
        rows: dict[str, int] = {}
        for group in self.groups:
            for job in group.jobs:
                if not job.done:
                    rows[job.request.user_id] = rows.get(job.request.user_id, 0) + job.end - job.start
        share = 1 / max(len(rows), 1)
        return {id(group): sum(share * (job.end - job.start) / rows[job.request.user_id]
                               for job in group.jobs if not job.done) for group in self.groups}

    def _merge(self) -> None:
        """At the chunk boundary, groups on one base become one (decoding.py, `absorb`) where their sizes allow
        (`may_share`, or one user's alone): the oldest takes in the others' calls still decoding, so samples that
        arrived apart decode as one batch from the next chunk. A group whose finished calls hold half its rows or
        more drops them first."""
        by_base: dict[int, list[DecodeGroup]] = {}
        for group in self.groups:
            if not group.mergeable:
                continue
            if group.live_rows * 2 <= group.rows:
                try:
                    group.absorb([])  # alone: keeps the rows of the calls still decoding
                except Exception:  # noqa: BLE001 - e.g. out of memory for the copy: it decodes as it was
                    log.warning("a decode group could not drop its finished rows", exc_info=True)
            by_base.setdefault(id(group.entry), []).append(group)
        for groups in by_base.values():
            clusters: list[tuple[DecodeGroup, list[DecodeGroup]]] = []  # each head and the groups it takes in
            for group in groups:
                for head, taken in clusters:
                    users = group.users.union(*(member.users for member in (head, *taken)))
                    if len(users) == 1 or may_share(sum(member.live_rows for member in (head, *taken)), group.live_rows,
                                                    group.device):
                        taken.append(group)
                        break
                else:
                    clusters.append((group, []))
            for head, taken in clusters:
                if not taken:
                    continue
                try:
                    head.absorb(taken)
                except Exception:  # noqa: BLE001 - e.g. out of memory for the stacked cache: they decode apart, as before
                    log.warning("decode groups on one base could not merge; they go on apart", exc_info=True)
                    continue
                for group in taken:
                    self.groups.remove(group)

    def _stream(self, group: DecodeGroup, job: SampleJob) -> None:
        """A streamed job's progress after a chunk: each sequence's newly settled text and ids (none once finished)."""
        tokenizer = group.entry.base.tokenizer
        if not job.streams:
            stops = job.settings.stop

            def decode(ids: list[int]) -> str:
                return cast(str, tokenizer.decode(ids, skip_special_tokens=True))  # one sequence in, one str out

            job.streams = [IncrementalText(decode, stops) for _ in job.tokens]
        rows: list[SequenceChunk] = []
        for i, stream in enumerate(job.streams):
            if job.reasons[i] is not None:
                rows.append({"text": "", "tokens": [], "logprobs": []})
                continue
            start = stream.ids
            text, count = stream.step(job.tokens[i])
            rows.append({"text": text, "tokens": job.tokens[i][start:start + count],
                         "logprobs": job.logprobs[i][start:start + count]})
        if any(row["text"] or row["tokens"] for row in rows):
            n = job.settings.num_samples
            chunk = SampleChunk(sequences=[rows[p * n:(p + 1) * n] for p in range(len(job.prompt_ids))])
            assert job.request.progress is not None
            job.request.progress(chunk)

    def fail_all(self, error: SignalError, groups: list[DecodeGroup] | None = None) -> None:
        """Fail every call still decoding in `groups` (all groups: a rank failed) and drop those groups."""
        for group in list(self.groups if groups is None else groups):
            for job in group.jobs:
                if not job.done:
                    job.done = True
                    self._release(job)
                    self.shared.scheduler.finish(job.request, error)
            self.groups.remove(group)

    def _finished(self, group: DecodeGroup, job: SampleJob) -> SampleResult:
        """A job's answer, remembered for a retry."""
        result = {**group.result(job), "compute_seconds": job.compute_seconds}
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
        return {run_id for group in self.groups for run_id in group.run_ids}


def _partition(jobs: list[SampleJob], device: torch.device) -> list[list[SampleJob]]:
    """The decode groups a tick's calls on one base start in: each user's calls together, and users together where
    their rows may share a group (`may_share`); calls in their order of arrival within each."""
    by_user: dict[str, list[SampleJob]] = {}
    for job in jobs:
        by_user.setdefault(job.request.user_id, []).append(job)
    parts: list[tuple[list[SampleJob], int]] = []
    for mine in sorted(by_user.values(), key=_rows):
        index = next((i for i, (part, rows) in enumerate(parts) if may_share(rows, _rows(mine), device)), None)
        if index is None:
            parts.append((mine, _rows(mine)))
        else:
            parts[index] = (parts[index][0] + mine, parts[index][1] + _rows(mine))
    order = {id(job): i for i, job in enumerate(jobs)}
    return sorted((sorted(part, key=lambda job: order[id(job)]) for part, _ in parts), key=lambda p: order[id(p[0])])


def _rows(jobs: list[SampleJob]) -> int:
    return sum(len(job.prompt_ids) * job.settings.num_samples for job in jobs)


def _answer_key(call: Sample) -> tuple[str, str]:
    return (call.run_id or f"user:{call.user_id}", call.request_id or "")


def render_chat(call: RenderChat, entry: BaseEntry, tokenizer: Any) -> RenderChatResult:
    """Messages through the chat template as ids (tokenize=True: the template's own BOS, once), ids as text, with
    `tokenizer`: the base's in the tick, a copy of it off the tick (gpu_runtime/engine/off_tick.py)."""
    ids = None
    check_text_fits(call, tokenizer, entry.renderer.max_length)
    if call.messages is not None:
        ids = render_messages(tokenizer, call.messages, call.tools, call.prefill)
    texts = None if call.prompts is None else [list(tokenizer(p, add_special_tokens=True)["input_ids"])
                                                for p in call.prompts]  # as prepare() tokenises a text prompt
    vocab = entry.renderer.vocab_size
    pieces = [cast(str, tokenizer.decode([t], skip_special_tokens=True)) if t < vocab else ""  # one id in, one str
              for t in call.decode or []]
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


def check_text_fits(call: RenderChat, tokenizer: Any, context_length: int) -> None:
    """Refuse text that cannot fit the context before tokenizing it: past context x the longest token's bytes it
    is more tokens than the context holds, whatever they are (a 6 MB prompt took seconds of this thread)."""
    bound = context_length * longest_token_bytes(tokenizer)
    for i, prompt in enumerate(call.prompts or []):
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise BadInput(f"prompt {i} is {size} bytes: more than the {context_length} tokens of the model's context "
                           f"can hold (at most {bound} bytes)", field="prompt")
    size = sum(len(str(m.get("content") or "").encode("utf-8", "surrogatepass")) for m in call.messages or [])
    if size > bound:
        raise BadInput(f"the messages are {size} bytes: more than the {context_length} tokens of the model's "
                       f"context can hold (at most {bound} bytes)", field="messages")
