"""Where the templates and static files are: beside this package, never the working directory,
since `signal serve` is often started elsewhere."""

from __future__ import annotations

from app.resources import resource_dir

TEMPLATES = resource_dir("templates")
STATIC = resource_dir("static")
