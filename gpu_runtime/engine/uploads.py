"""Hub uploads of saved checkpoints, each on a thread of its own (save_state(push_to_hub=True)).

The checkpoint is written in its tick, then uploaded off the tick, so other runs' calls go on meanwhile; its run's
next call waits, as the save is answered only after. An upload that fails takes back what its save made: a checkpoint
written for it is removed (the call answered an error, so the server lists nothing, and nothing invisible may keep
its name); one that was there before (a nameless save again at its step) stays, as it is listed.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.contract import SaveState, SaveStateResult, default_checkpoint_name
from gpu_runtime.engine.request import Answer, Request
from gpu_runtime.engine.run_state import RunState, checkpoint_dir
from gpu_runtime.engine.shared import Shared, internal
from gpu_runtime.errors import SignalError

UPLOAD_GRACE_SECONDS = 300  # at shutdown, Hub uploads in flight get this long to finish and answer


class Uploads:
    def __init__(self, shared: Shared, save: Callable[[RunState, SaveState], SaveStateResult]) -> None:
        self.shared = shared
        self.save = save  # Control.save_state
        self.threads: set[threading.Thread] = set()  # in flight, each answering its save_state

    def save_then_upload(self, request: Request, state: RunState, call: SaveState,
                         answer: Callable[[Answer], None]) -> None:
        from gpu_runtime.engine import hub  # huggingface_hub, only for runs that upload

        existed = checkpoint_dir(state.paths, call.mode, call.name or default_checkpoint_name(state.step)).is_dir()
        try:
            hub_model_id, hf_token = hub.check_push(call.hub_model_id, call.hf_token)
            result = self.save(state, call)
            upload = functools.partial(
                hub.push_checkpoint, Path(result.checkpoint_path), hub_model_id=hub_model_id, hf_token=hf_token,
                base_model=self.shared.entry(state).base.name, manifest=state.paths.manifest, mode=result.mode,
                step=result.step, run_id=state.run_id)
        except SignalError as exc:
            answer(exc)
            return
        except Exception as exc:  # noqa: BLE001 - one bad call must not take the runtime down
            answer(internal(exc, request))
            return

        def run() -> None:
            try:  # upload time is not compute time
                uploaded: Answer = dataclasses.replace(result, hub=upload())
            except SignalError as exc:
                uploaded = exc
            except Exception as exc:  # noqa: BLE001
                uploaded = internal(exc, request)
            if isinstance(uploaded, SignalError) and not existed:
                if call.request_id:
                    state.answered.pop(call.request_id, None)  # a retry saves and uploads again
                shutil.rmtree(result.checkpoint_path, ignore_errors=True)
                print(f"run {state.run_id}: the upload failed; its checkpoint {result.name!r} was removed",
                      file=sys.stderr)
            self.shared.scheduler.finish(request, uploaded)
            self.threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"hub-upload-{state.run_id[:8]}", daemon=True)
        self.shared.scheduler.hold(state.run_id)  # in progress outside the picks: not picked again until answered
        self.threads.add(thread)
        thread.start()

    def wait(self) -> None:
        for thread in list(self.threads):
            thread.join(timeout=UPLOAD_GRACE_SECONDS)
