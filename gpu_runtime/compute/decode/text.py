"""Stop strings checked as a sequence grows, in time proportional to its new text only.

`StopText.push` decodes only the tokens since the last settled point (a prefix window and a read offset, as vLLM's
incremental detokeniser keeps them) and searches for the stop strings only in the new text plus the last
(longest stop - 1) characters before it. detokenize.py's IncrementalText decodes the whole sequence every call; this
is the decode engine's per-token check, not a replacement for a stream's settled text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decode gives for the bytes of a character not yet complete


class StopText:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the text of tokens[:read]
        self.prefix = 0  # tokens before it are settled; tokens[prefix:read] give the context the next decode needs
        self.read = 0

    def push(self, tokens: list[int]) -> int | None:
        """`tokens` is the whole sequence so far (grown since the last call): where the first stop string starts in
        the text, or None. Decodes tokens[prefix:] and tokens[prefix:read] only."""
        before = self.decode(tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        full = self.decode(tokens[self.prefix:])
        if len(full) <= len(before) or full.endswith(REPLACEMENT) or not full.startswith(before):
            return None  # an incomplete character (or a rewrite of the window): wait for more tokens
        start = max(0, len(self.text) - self.longest + 1)
        self.text += full[len(before):]
        self.prefix, self.read = self.read, len(tokens)
        cuts = [k for k in (self.text.find(s, start) for s in self.stops) if k >= 0]
        return min(cuts) if cuts else None
