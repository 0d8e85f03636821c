"""render_chat answered as it arrives, on the caller's thread, when its base is resident: it only reads the
tokenizer, and waiting for the tick (behind a decode chunk, up to `decode_chunk_seconds`) put a whole tick between a
/v1 request and its sample. Anything else (a base to load, a run to restore, an error) goes to the tick as before.

It renders with a copy of the base's tokenizer, one per base, under a lock: a Rust tokenizer shared with the tick's
thread can fail with "Already borrowed" when either changes its padding or truncation.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

from gpu_runtime.compute.quantization import base_key
from gpu_runtime.contract import RenderChat, RenderChatResult
from gpu_runtime.engine.residency import Residency
from gpu_runtime.engine.sampling_calls import render_chat


class OffTick:
    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self.lock = threading.Lock()
        # a base's tokenizer: its copy (weak: an evicted base's copy goes with it)
        self.copies: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def render_chat(self, call: RenderChat) -> RenderChatResult | None:
        """The answer now, or None: the tick answers it."""
        if call.run_id is not None:
            state = self.residency.runs.get(call.run_id)  # a dict read: safe while the tick changes residency
            key = state.base_key if state is not None else None
        else:
            key = base_key(str(call.base_model), None)
        entry = self.residency.bases.get(key) if key is not None else None
        if entry is None:
            return None
        with self.lock:
            try:
                return render_chat(call, entry, self._copy(entry.base.tokenizer))
            except Exception:  # noqa: BLE001 - the tick renders it again and answers its error as it always has
                return None

    def _copy(self, tokenizer: Any) -> Any:
        if tokenizer not in self.copies:
            self.copies[tokenizer] = copy.deepcopy(tokenizer)
        return self.copies[tokenizer]
