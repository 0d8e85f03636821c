from __future__ import annotations

import pickle

import pytest

from gpu_runtime import errors
from gpu_runtime.errors import BadInput, SignalError


def all_error_classes() -> list[type[SignalError]]:
    return sorted(errors._registry().values(), key=lambda cls: cls.__name__)


@pytest.mark.parametrize("cls", all_error_classes(), ids=lambda cls: cls.__name__)
def test_every_error_pickles_and_round_trips_as_data(cls: type[SignalError]) -> None:
    original = cls("something went wrong", field="batch[2].output")

    unpickled = pickle.loads(pickle.dumps(original))
    rebuilt = SignalError.from_dict(original.to_dict())

    for copy in (unpickled, rebuilt):
        assert type(copy) is cls
        assert copy.message == "something went wrong"
        assert copy.field == "batch[2].output"
        assert copy.code == cls.code


def test_errors_are_also_builtin_exceptions() -> None:
    assert isinstance(BadInput("x"), ValueError)
    assert isinstance(errors.RunNotFound("x"), LookupError)
    assert isinstance(errors.WorkerFailed("x"), RuntimeError)


def test_unknown_error_type_becomes_internal_error() -> None:
    rebuilt = SignalError.from_dict({"type": "NoSuchError", "message": "m"})
    assert type(rebuilt) is errors.InternalError
