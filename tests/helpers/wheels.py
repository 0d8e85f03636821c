"""Wheels of this tree installed into fresh venvs: what `pip install` gives a machine with no checkout.

The venv's own pip installs the wheels (`--no-deps --no-index`: no index reached): the test venv's pip would
uninstall the test venv's editable install of this repository first.
"""

from __future__ import annotations

import fcntl
import importlib.util
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "rewardsignal"
# httpx and what it imports: all an installed SDK may borrow (anyio needs typing_extensions before Python 3.13).
HTTPX_CLOSURE = ("httpx", "httpcore", "h11", "anyio", "idna", "certifi", "sniffio", "typing_extensions")


def build_wheel(source: Path, dest: Path) -> Path:
    """The wheel of the project at `source` (its own pyproject.toml), built offline."""
    before = set(dest.glob("*.whl")) if dest.is_dir() else set()
    # One build of a source tree at a time: setuptools writes build/ and *.egg-info inside it, and `make test`'s
    # two pytest-xdist workers may both build the SDK's wheel at once (tests/sdk, tests/app).
    with open(Path(tempfile.gettempdir()) / f"signal-wheel{str(source.resolve()).replace('/', '-')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(dest)], check=True, capture_output=True, timeout=300)
    (wheel,) = set(dest.glob("*.whl")) - before
    return wheel


def fresh_venv(root: Path, wheels: list[Path]) -> tuple[Path, Path]:
    """A venv without system site packages holding `wheels` only; returns (its python, its site-packages)."""
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    # Isolated (-I: no PYTHONPATH): the checkout on the path carries the egg-info a wheel build leaves there, and
    # pip would take that for this project installed already.
    subprocess.run([str(python), "-I", "-m", "pip", "install", "--no-deps", "--no-index", "-q", *map(str, wheels)],
                   check=True, capture_output=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    return python, Path(purelib)


def borrow(purelib: Path, names: tuple[str, ...]) -> None:
    """Symlink the test venv's copies of just these top-level modules into `purelib`."""
    for name in names:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, name
        origin = Path(spec.origin)
        source = origin.parent if origin.name == "__init__.py" else origin
        (purelib / source.name).symlink_to(source, target_is_directory=source.is_dir())
