"""Screenshots (issue 18 §10): a test run leaves the committed set alone; `make screenshots` makes it on purpose."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.web.conftest import COMMITTED_SCREENSHOTS, TEST_SCREENSHOTS, committing_screenshots, screenshots_dir

REPO = Path(__file__).resolve().parents[2]


def test_a_test_run_writes_screenshots_to_an_ignored_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIGNAL_TEST_SCREENSHOTS", raising=False)
    assert screenshots_dir() == TEST_SCREENSHOTS and not committing_screenshots()
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(TEST_SCREENSHOTS / "run.png")], cwd=REPO, check=False)
    assert ignored.returncode == 0, "build/screenshots/ must be ignored by git"


def test_make_screenshots_writes_the_committed_set(monkeypatch: pytest.MonkeyPatch) -> None:
    target = re.search(r"^screenshots:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert target, "the Makefile has a screenshots target"
    variable, value = target.group(1).split()[0].split("=")
    monkeypatch.setenv(variable, str(REPO / value))
    assert screenshots_dir().resolve() == COMMITTED_SCREENSHOTS.resolve() and committing_screenshots()


def test_the_readmes_pictures_are_committed_screenshots() -> None:
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (REPO / "README.md").read_text())
    assert pictures, "the README shows the run page"
    for picture in pictures:
        assert (REPO / picture).is_file(), picture
        assert (REPO / picture).resolve().parent == COMMITTED_SCREENSHOTS.resolve(), picture
