"""The SDK's typed errors: whole after pickling (RL users' multiprocessing workers log them), and one for every
code the server can answer with, so a code added to the server without an SDK class fails here."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

import app.errors
import gpu_runtime.errors
import rewardsignal
from rewardsignal.errors import SignalAPIError, error_for_code

ROOT = Path(__file__).resolve().parents[2]
# Where a code is spelled as a literal: `code = "X"` on a class, or `"code": "X"` in an answer built by hand.
CODE_LITERAL = re.compile(r"""\bcode["']?\s*[:=]\s*["']([A-Z][A-Z_]+)["']""")
SERVER_SOURCES = ("app", "web", "gpu_runtime")


def sdk_error_classes() -> list[type[SignalAPIError]]:
    found, stack = set(), [SignalAPIError]
    while stack:
        cls = stack.pop()
        found.add(cls)
        stack.extend(cls.__subclasses__())
    return sorted(found, key=lambda cls: cls.__name__)


def server_codes() -> set[str]:
    """Every code the server can put in `extensions.code`: its error classes, literals, and the README's list."""
    codes = {cls.code for cls in gpu_runtime.errors._registry().values()}
    codes |= {cls.code for cls in vars(app.errors).values() if isinstance(cls, type) and issubclass(cls, gpu_runtime.errors.SignalError)}
    for folder in SERVER_SOURCES:
        for source in (ROOT / folder).rglob("*.py"):
            codes |= set(CODE_LITERAL.findall(source.read_text()))
    readme = (ROOT / "README.md").read_text()
    listing = readme[readme.index("Errors carry\n`extensions.code`"):readme.index("The SDL is")]
    codes |= set(re.findall(r"`([A-Z][A-Z_]{3,})`", listing)) - {"SIGNAL_MAX_REQUEST_BYTES"}
    return codes


@pytest.mark.parametrize("cls", sdk_error_classes(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("code", [None, "SOME_NEWER_CODE"], ids=["own code", "other code"])
def test_every_error_survives_pickling_whole(cls: type[SignalAPIError], code: str | None) -> None:
    original = cls("loraR must be between 1 and 512", code=code, field="loraR", path=["createRun"], retryable=False,
                   details={"resource": "calls"})

    copy = pickle.loads(pickle.dumps(original))

    assert type(copy) is cls
    assert str(copy) == str(original) == f"[{code or cls.code}] loraR must be between 1 and 512"
    assert copy.args == original.args
    assert (copy.message, copy.code, copy.field, copy.path) == (original.message, original.code, "loraR",
                                                                ["createRun"])
    assert (copy.retryable, copy.details) == (False, {"resource": "calls"})  # DEADLINE_EXCEEDED's "never again" kept


def test_every_sdk_class_is_exported() -> None:
    assert {cls.__name__ for cls in sdk_error_classes()} <= set(dir(rewardsignal))


def test_the_server_codes_are_found() -> None:
    # The enumeration itself: the classes, the hand-built answers (server.py's 413) and the README's list.
    assert {"BAD_INPUT", "PAYLOAD_TOO_LARGE", "GRAPHQL_VALIDATION_FAILED", "HUB_ERROR", "INSUFFICIENT_CREDITS",
            "INTERNAL"} <= server_codes()


@pytest.mark.parametrize("code", sorted(server_codes()))
def test_every_server_code_has_an_sdk_class(code: str) -> None:
    error = error_for_code(code, "message")
    assert type(error) is not SignalAPIError, f"no SDK class for the server's {code}: add one to rewardsignal/errors.py"
    assert error.code == code
