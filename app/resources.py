"""Where the server's own files are: templates, static assets, migrations and the model catalogue.

In a checkout they sit beside the packages; a wheel (pip install, a Modal image) carries them as
data files under `{sys.prefix}/share/signal/` (pyproject's `[tool.setuptools.data-files]`). Never
the working directory: `signal serve` is often started elsewhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
_INSTALLED = Path(sys.prefix) / "share" / "signal"
NAMES = ("templates", "static", "migrations", "config")


def resource_dir(name: str) -> Path:
    """The directory `name` (one of NAMES): the checkout's when running from one, else the installed copy."""
    if name not in NAMES:
        raise ValueError(f"unknown resource directory {name!r}; known: {', '.join(NAMES)}")
    checkout = _CHECKOUT / name
    return checkout if (_CHECKOUT / "pyproject.toml").is_file() and checkout.is_dir() else _INSTALLED / name
