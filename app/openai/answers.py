"""A sample's result in OpenAI's shapes. Text, token ids and logprobs leave out the matched stop string and the
EOS token, as OpenAI does (Signal's own `sample` keeps them); `usage.completion_tokens` counts every generated
token, the stop token included, and `prompt_tokens` the rendered prompts' ids."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from app.openai import tool_answers
from app.openai.params import CompletionRequest
from gpu_runtime.contract import SampledSequence, SampleResult
from gpu_runtime.contract.json_types import JSONObject

FLOOR = -9999.0  # a logprob of -inf (a token top_p ruled out) as a finite number: JSON has no infinity


def finite(value: float | None) -> float | None:
    return None if value is None else (float(value) if math.isfinite(value) else FLOOR)


@dataclass
class Choice:
    """One generated sequence, its stop left out (`ids`, `logprobs`, `topk` cut to the kept tokens)."""

    index: int
    prompt: int  # which prompt
    text: str
    ids: list[int]
    logprobs: list[float]
    topk: list[list[list[float]]] | None
    finish_reason: str
    generated: int  # every token generated, the stop token included


def cut_at_stop(sequence: SampledSequence, eos: set[int]) -> bool:
    """Whether `kept` needs the text of the sequence's tokens: it stopped, and not on an EOS token."""
    tokens = sequence.tokens
    return sequence.stop_reason == "stop" and bool(tokens) and tokens[-1] not in eos


def kept(sequence: SampledSequence, pieces: dict[int, str], eos: set[int]) -> int:
    """How many of the sequence's tokens its answer keeps: all but a final EOS, or those before a stop string
    (the runtime cut the text at the match; the token that completed it goes, with any after the cut)."""
    tokens = sequence.tokens
    if sequence.stop_reason != "stop" or not tokens:
        return len(tokens)
    if tokens[-1] in eos:
        return len(tokens) - 1
    length, limit = 0, len(sequence.text)
    for k, token in enumerate(tokens):
        length += len(pieces.get(token, ""))
        if length > limit:
            return k
    return len(tokens)


def choices(result: SampleResult, pieces: dict[int, str], eos: set[int]) -> list[Choice]:
    out: list[Choice] = []
    for p, sequences in enumerate(result.sequences):
        for sequence in sequences:
            k = kept(sequence, pieces, eos)
            topk = sequence.topk_logprobs
            out.append(Choice(index=len(out), prompt=p, text=sequence.text, ids=list(sequence.tokens[:k]),
                              logprobs=list(sequence.logprobs[:k]), topk=topk[:k] if topk is not None else None,
                              finish_reason="stop" if sequence.stop_reason == "stop" else "length",
                              generated=len(sequence.tokens)))
    return out


def usage(prompt_ids: list[list[int]], picked: list[Choice], cached: int = 0) -> JSONObject:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens found in the decode cache."""
    prompt, completion = sum(len(ids) for ids in prompt_ids), sum(c.generated for c in picked)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _entry(token: int, logprob: float, pieces: dict[int, str]) -> JSONObject:
    piece = pieces.get(token, "")
    return {"token": piece, "logprob": finite(logprob), "bytes": list(piece.encode("utf-8"))}


def chat_logprobs(choice: Choice, request: CompletionRequest, pieces: dict[int, str]) -> JSONObject | None:
    """Chat's shape: content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    if request.logprobs is None:
        return None
    content = []
    for i, (token, logprob) in enumerate(zip(choice.ids, choice.logprobs)):
        tops = choice.topk[i][:request.logprobs] if choice.topk is not None and request.logprobs else []
        content.append({**_entry(token, logprob, pieces),
                        "top_logprobs": [_entry(int(t), lp, pieces) for t, lp in tops]})
    return {"content": content, "refusal": None}


def completion_logprobs(choice: Choice, request: CompletionRequest, pieces: dict[int, str], prompt_ids: list[int],
                        prompt_text: str, result: SampleResult) -> JSONObject | None:
    """The legacy shape {tokens, token_logprobs, top_logprobs, text_offset}; with echo the prompt's positions
    first (null at 0). Offsets count characters in prompt + completion, as OpenAI's do."""
    if request.logprobs is None:
        return None
    k = request.logprobs
    tokens: list[int] = []
    values: list[float | None] = []
    tops: list[list[list[float]] | None] = []
    if request.echo:
        tokens += prompt_ids
        values += [finite(v) for v in (result.prompt_logprobs or [])[choice.prompt]]  # echo asks for them
        prompt_tops = result.topk_prompt_logprobs
        tops += prompt_tops[choice.prompt] if prompt_tops is not None else [None] * len(prompt_ids)
    tokens += choice.ids
    values += [finite(v) for v in choice.logprobs]
    tops += choice.topk if choice.topk is not None else [None] * len(choice.ids)
    offset = 0 if request.echo else len(prompt_text)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(pieces.get(token, ""))
    return {"tokens": [pieces.get(t, "") for t in tokens], "token_logprobs": values,
            "top_logprobs": [None if top is None or not k else {pieces.get(int(t), ""): finite(lp) for t, lp in top[:k]}
                             for top in tops],
            "text_offset": offsets}


def body(result: SampleResult, params: CompletionRequest, prompt_ids: list[list[int]], picked: list[Choice],
         pieces: dict[int, str]) -> JSONObject:
    """The whole answer: a chat.completion or a text_completion, with usage."""
    prompt_texts = [p if isinstance(p, str) else "".join(pieces.get(t, "") for t in p) for p in
                    (params.prompts or prompt_ids)]
    usage_ = usage(prompt_ids, picked, result.prompt_cache_hit_tokens)
    head: JSONObject = {"id": f"{'chatcmpl' if params.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": params.model}
    if params.chat:
        answer: JSONObject = {**head, "object": "chat.completion", "choices": [chat_choice(c, params, pieces) for c in picked],
                  "usage": usage_}
        if params.return_token_ids:
            answer["prompt_token_ids"] = prompt_ids[0]
        return answer
    items = [completion_choice(c, params, pieces, prompt_ids, prompt_texts, result) for c in picked]
    return {**head, "object": "text_completion", "choices": items, "usage": usage_}


def chat_choice(choice: Choice, params: CompletionRequest, pieces: dict[int, str]) -> JSONObject:
    message, finish, said = tool_answers.message(choice.text, choice.finish_reason, params.tools)
    item: JSONObject = {"index": choice.index, "message": message,
                            "logprobs": chat_logprobs(choice, params, pieces), "finish_reason": finish, **said}
    if params.return_token_ids:
        item["token_ids"] = choice.ids
    return item


def completion_choice(choice: Choice, params: CompletionRequest, pieces: dict[int, str], prompt_ids: list[list[int]],
                      prompt_texts: list[str], result: SampleResult) -> JSONObject:
    prompt_text = prompt_texts[choice.prompt]
    item: JSONObject = {
        "index": choice.index, "text": (prompt_text if params.echo else "") + choice.text,
        "logprobs": completion_logprobs(choice, params, pieces, prompt_ids[choice.prompt], prompt_text, result),
        "finish_reason": choice.finish_reason}
    if params.return_token_ids:
        item["prompt_token_ids"] = prompt_ids[choice.prompt]
        item["token_ids"] = choice.ids
    return item
