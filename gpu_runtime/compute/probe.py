"""What this machine's runtime would have: torch, CUDA and its GPUs, as one JSON line.

    python -m gpu_runtime.compute.probe

`signal doctor` runs it in a subprocess, so the server itself never imports torch.
"""

from __future__ import annotations

import json
from typing import TypedDict


class Probe(TypedDict, total=False):
    """What the doctor learns of torch in the runtime's environment: its version and GPUs, or why it did not import."""

    torch_error: str
    torch: str
    cuda: bool
    gpus: list[str]


def probe() -> Probe:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install is what the doctor reports
        return {"torch_error": f"{type(exc).__name__}: {exc}"}
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    return {"torch": torch.__version__, "cuda": cuda, "gpus": gpus}


if __name__ == "__main__":
    print(json.dumps(probe()))
