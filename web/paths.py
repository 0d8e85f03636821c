"""Where the templates and static files are: beside this package, never the working directory,
since `signal serve` is often started elsewhere."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
STATIC = ROOT / "static"
