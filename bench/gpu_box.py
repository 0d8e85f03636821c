"""Time boxes for bench/gpu.sh's sections: each section prints one JSON line, or one saying why it was skipped.

A part (one process) ends by the earlier of its own `--seconds` and the script's global `--deadline` (an epoch
time: gpu.sh's start + 290 s). Its sections run most important first; each gets its nominal limit (seconds on an
H100), scaled down in proportion when what is left of the part is less than the sum of the sections still to run,
and not less than the least it is worth starting with. A section adapts its rounds to its limit (`Limit`); one
that overruns it by GRACE_S is cut by a watchdog that prints its error line and the rest's skip lines, then ends
the process, so the part still ends inside its `timeout` with a line for every section. A section that raises
prints its error and the part goes on with the next.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchlib import log

GRACE_S = 10.0  # past its limit a section is cut: rounds adapt to the limit, so only a hang or a slow step gets here
OVERRUN_RC = 124  # as `timeout`'s: gpu.sh reads the part as timed out


@dataclass(frozen=True)
class Limit:
    """A section's time: its deadline (time.monotonic()) and how long it was given."""

    deadline: float
    seconds: float

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Section:
    name: str
    nominal_s: float  # its limit when the part has room for every section still to run
    least_s: float  # the least limit worth starting it with
    run: Callable[[Limit], dict[str, Any]]


class Box:
    def __init__(self, part: str, seconds: float, deadline: float | None = None) -> None:
        end = time.monotonic() + seconds
        if deadline is not None:  # an epoch time: the whole script's end, shared by every part
            end = min(end, time.monotonic() + deadline - time.time())
        self.part, self.deadline = part, end
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, sections: list[Section], i: int) -> float:
        """Section i's limit: nominal when the rest fit, else its share of what is left, at least its least."""
        left, wanted = self.left(), sum(s.nominal_s for s in sections[i:])
        share = sections[i].nominal_s if left >= wanted else left * sections[i].nominal_s / wanted
        return min(left, max(share, sections[i].least_s))

    def print(self, name: str, line: dict[str, Any]) -> None:
        print(json.dumps({"part": self.part, "section": name, **line}), flush=True)

    def run_all(self, sections: list[Section]) -> None:
        for i, section in enumerate(sections):
            if self.left() < section.least_s:
                self.print(section.name, {"skipped": f"needs {section.least_s:.0f} s, {max(self.left(), 0):.0f} s "
                                                     "left in the part"})
                continue
            self.run(section, self.limit(sections, i), [s.name for s in sections[i + 1:]])

    def run(self, section: Section, seconds: float, after: list[str]) -> None:
        started = time.monotonic()
        log(f"{self.part}/{section.name}: start, {seconds:.0f} s limit ({self.left():.0f} s left in the part)")
        watchdog = threading.Timer(seconds + GRACE_S, self._overrun, (section.name, seconds, started, after))
        watchdog.daemon = True
        watchdog.start()
        try:
            line = section.run(Limit(started + seconds, seconds))
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others' lines
            log(traceback.format_exc())
            line = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        watchdog.cancel()
        with self._lock:  # the watchdog may be printing this very section's line
            self.print(section.name, {**line, "limit_s": round(seconds), "seconds": round(time.monotonic() - started, 1)})

    def _overrun(self, name: str, seconds: float, started: float, after: list[str]) -> None:
        """The watchdog: the section hangs or is far slower than its limit; its line and the rest's, then exit."""
        if not self._lock.acquire(blocking=False):
            return  # the section finished as the timer fired
        self.print(name, {"error": f"cut at {seconds + GRACE_S:.0f} s: over its {seconds:.0f} s limit",
                          "limit_s": round(seconds), "seconds": round(time.monotonic() - started, 1)})
        for later in after:
            self.print(later, {"skipped": f"the part ended when {name} was cut"})
        os._exit(OVERRUN_RC)


def sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def timed(device: Any, fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes, the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class Measure:
    """A `measure` for benchlib.alternate on a device: seconds with the device drained, and each side's peak memory
    (GiB, CUDA only) over its timed steps."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.peaks: dict[str, float] = {}
        self.cuda = getattr(device, "type", str(device)) == "cuda"

    def __call__(self, name: str, fn: Callable[[], Any]) -> float:
        import torch

        if self.cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats()
        took = timed(self.device, fn)
        if self.cuda:
            peak = round(torch.cuda.max_memory_allocated() / 1024**3, 2)
            self.peaks[name] = max(peak, self.peaks.get(name, 0.0))
        return took


def launches(fn: Callable[[], Any]) -> dict[str, Any]:
    """One call of `fn` under torch's profiler: kernel launches, device-busy time and wall time (the profiler's own
    overhead included, so busy/wall is a floor)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.events()
    if cuda:
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time_total for e in kernels if e.device_time_total)
        count = len(kernels)
    else:  # on the CPU: the aten ops dispatched, the nearest thing to a launch
        ops = [e for e in events if e.name.startswith("aten::")]
        count, busy_us = len(ops), sum(e.self_cpu_time_total for e in ops)
    return {"kernel_launches": count, "device_busy_ms": round(busy_us / 1000, 1), "profiled_wall_ms": round(wall * 1000, 1),
            "busy_of_wall": round(busy_us / 1000 / (wall * 1000), 3) if wall else None}
