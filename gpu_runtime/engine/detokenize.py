"""Incremental detokenisation for streamed samples: what of a growing sequence's text is settled enough to send.

Each decode chunk decodes the whole sequence again (as the final answer does), so the pieces sent concatenate to
the final text; what is held back is a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and any end that
could be the start of a stop string (the final text leaves a matched stop out, so it must never have been sent).
The ids sent are those whose text is wholly inside what was sent. Written here rather than taken from
`tokenizers.decoders.DecodeStream`, which steps one token at a time without stop strings, and whose pieces need not
add up to `decode(all ids)`. No torch: `decode` is the tokenizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decode gives for the bytes of a character not yet complete


def settled(text: str, stops: Sequence[str]) -> str:
    """`text` less a trailing incomplete character and the longest end that is a proper start of a stop string."""
    text = text.rstrip(REPLACEMENT)
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return text[:len(text) - held]


class IncrementalText:
    """One sequence's stream: `step` with all its ids so far gives the text and the count of ids settled since."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self.text = ""  # sent so far
        self.ids = 0  # ids sent so far

    def step(self, tokens: list[int]) -> tuple[str, int]:
        """The new settled text and how many more ids are settled (both may be empty)."""
        full = self.decode(tokens)
        stable = settled(full, self.stops)
        if not stable.startswith(self.text):
            return "", 0  # a decode that rewrote what was sent (cleanup of spaces): wait for the final answer
        delta, before = stable[len(self.text):], self.ids
        if stable == full:
            self.ids = len(tokens)
        else:  # some text is held back: only the ids whose text was all sent
            while self.ids < len(tokens):
                prefix = self.decode(tokens[:self.ids + 1])
                if len(prefix) > len(stable) or prefix.endswith(REPLACEMENT):
                    break
                self.ids += 1
        self.text = stable
        return delta, self.ids - before
