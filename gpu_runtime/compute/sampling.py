"""Choosing each next token: temperature, top-k and top-p, with the model's own logprobs.

Reported logprobs are the model's own (temperature 1, unfiltered) log-probabilities of each chosen token: the
quantity a teacher-forced forward returns, whatever temperature, top-k or top-p chose it (docs/SAMPLING.md).
The decoding loop itself is `decoding.DecodeGroup`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpu_runtime.contract import SamplingSettings


def choose_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row; return (tokens, their logprobs under the unmodified model)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if settings.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / settings.temperature
        if settings.top_k > 0:
            kth = torch.topk(scaled, min(settings.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        if settings.top_p < 1:
            ordered, order = torch.sort(scaled, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Drop a token when the tokens before it already cover top_p (the first always stays).
            drop = probs.cumsum(dim=-1) - probs > settings.top_p
            scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
        tokens = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[list[float]]]:
    """Per row of `logits` [rows, vocab], the k most likely [token, logprob] pairs, most likely first."""
    values, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(k, logits.shape[-1]), dim=-1)
    return [[[int(t), float(v)] for t, v in zip(row_ids, row_values)]
            for row_ids, row_values in zip(ids.tolist(), values.tolist())]


# Most logits one chunk of the prompt's vocabulary projection holds (64 MiB in fp32): 64 rows x 512 positions x
# 49,152 would be 6.4 GB at once, so the positions are projected a few at a time.
LOGIT_CHUNK_ELEMENTS = 2**24


def score_prompts(hidden: torch.Tensor, input_ids: torch.Tensor, lengths: list[int], vocab: int,
                  project: Callable[[torch.Tensor], torch.Tensor], k: int
                  ) -> tuple[list[list[float | None]], list[list[list[list[float]] | None]]]:
    """Each left-padded prompt row's logprob of its own tokens (None at position 0) and, with k > 0, its top-k
    [token, logprob] pairs per position (most likely first; None at 0). `hidden` [rows, width, dim] is the final
    hidden state; `project` maps a slice of it to logits. Columns are projected in bounded chunks."""
    scores = PromptScores(input_ids, lengths, k)
    scores.add(hidden, 0, vocab, project)
    return scores.result()


class PromptScores:
    """`score_prompts` a piece of the prompt columns at a time (a chunked prefill's passes): each piece's hidden
    state is projected as it comes, and the rows' scores are read once every column has been added."""

    def __init__(self, input_ids: torch.Tensor, lengths: list[int], k: int) -> None:
        rows, width = input_ids.shape
        self.input_ids, self.lengths, self.k, self.width = input_ids, lengths, k, width
        self.first = width - max(lengths)  # columns before it are padding in every row
        self.own = torch.zeros(rows, width - 1)
        self.top_values = torch.zeros(rows, width - 1, k)
        self.top_ids = torch.zeros(rows, width - 1, k, dtype=torch.long)

    def add(self, hidden: torch.Tensor, offset: int, vocab: int, project: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The final hidden state of columns offset.. (column c predicts column c + 1)."""
        rows, k = hidden.shape[0], self.k
        chunk = max(1, LOGIT_CHUNK_ELEMENTS // max(rows * vocab, 1))
        for start in range(max(self.first, offset), min(offset + hidden.shape[1], self.width - 1), chunk):
            end = min(start + chunk, offset + hidden.shape[1], self.width - 1)
            logprobs = torch.log_softmax(project(hidden[:, start - offset:end - offset]).float(), dim=-1)
            own = logprobs.gather(-1, self.input_ids[:, start + 1:end + 1, None].to(logprobs.device)).squeeze(-1)
            self.own[:, start:end] = own.cpu()
            if k:
                values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
                self.top_values[:, start:end, :values.shape[-1]] = values.cpu()
                self.top_ids[:, start:end, :ids.shape[-1]] = ids.cpu()

    def result(self) -> tuple[list[list[float | None]], list[list[list[list[float]] | None]]]:
        scores: list[list[float | None]] = []
        tops: list[list[list[list[float]] | None]] = []
        for row, length in enumerate(self.lengths):
            columns = slice(self.width - length, self.width - 1)  # the columns predicting prompt positions 1..length-1
            scores.append([None, *self.own[row, columns].tolist()])
            tops.append([None, *([[int(t), float(v)] for t, v in zip(ids, values)]
                                 for ids, values in zip(self.top_ids[row, columns].tolist(),
                                                        self.top_values[row, columns].tolist()))])
        return scores, tops
