"""Time boxes for bench/gpu.sh's sections: each section prints one JSON line, or one saying why it was skipped.

A part (one process) gets a deadline (`--seconds`); a section starts only when its own box fits in what is left,
so the part ends inside its `timeout` and the script's 5-minute budget with a line for every section. A section
that raises prints its error and the part goes on with the next.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchlib import log


class Box:
    def __init__(self, part: str, seconds: float) -> None:
        self.part, self.deadline = part, time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, box_s: float, section: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run `section` if its box fits; print its JSON line (or the skip, or the error) and return its result."""
        if self.left() < box_s:
            line: dict[str, Any] = {"skipped": f"needs a {box_s:.0f} s box, {max(self.left(), 0):.0f} s left in the part"}
            result = None
        else:
            started = time.monotonic()
            log(f"{self.part}/{name}: start ({self.left():.0f} s left)")
            try:
                result = line = section()
            except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others' lines
                log(traceback.format_exc())
                result, line = None, {"error": f"{type(exc).__name__}: {exc}"[:800]}
            line = {**line, "seconds": round(time.monotonic() - started, 1)}
        print(json.dumps({"part": self.part, "section": name, **line}), flush=True)
        return result


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


def peak_memory(device: Any, fn: Callable[[], Any]) -> float | None:
    """GiB the device held at most while `fn` ran (None off CUDA)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    return round(torch.cuda.max_memory_allocated() / 1024**3, 2)


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
