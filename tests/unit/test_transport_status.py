"""The one table between dgr errors and gRPC status codes (dgr.transport.status)."""

from __future__ import annotations

import grpc
import pytest

from dgr import errors as E
from dgr.transport import status as st


def all_error_classes():
    return [c for c in E.all_classes() if c.__module__ == "dgr.errors"]


def test_every_listed_class_is_a_dgr_error_and_every_session_class_is_listed():
    assert all(issubclass(c, E.DgrError) for c in st.STATUS_OF)
    for name in ("SessionError", "StaleEpoch", "CacheMiss", "UnknownSession",
                 "ResourceExhausted", "ModelMismatch", "RouteError", "WorkerUnavailable",
                 "WorkerDraining", "StepDeadlineExceeded", "FrameError", "InvalidArgument",
                 "ContextFull", "InvalidBoundary", "EngineError"):
        assert getattr(E, name) in st.STATUS_OF, name


@pytest.mark.parametrize("cls,code", [
    (E.StaleEpoch, grpc.StatusCode.ABORTED),
    (E.CacheMiss, grpc.StatusCode.FAILED_PRECONDITION),
    (E.UnknownSession, grpc.StatusCode.NOT_FOUND),
    (E.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.ModelMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (E.RouteError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (E.WorkerDraining, grpc.StatusCode.UNAVAILABLE),
    (E.StepDeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (E.InvalidToken, grpc.StatusCode.INVALID_ARGUMENT),
    (E.ContextFull, grpc.StatusCode.OUT_OF_RANGE),
    (E.FrameChecksumError, grpc.StatusCode.DATA_LOSS),
    (E.FrameVersionError, grpc.StatusCode.UNIMPLEMENTED),
    (E.EngineError, grpc.StatusCode.INTERNAL),
    (E.DgrError, grpc.StatusCode.UNKNOWN),
])
def test_status_of(cls, code):
    assert st.status_of(cls) == code


@pytest.mark.parametrize("cls", all_error_classes(), ids=lambda c: c.__name__)
def test_round_trip_every_class(cls):
    exc = cls("boom") if cls is not E.ResourceExhausted else cls("boom", retry_after=1.5)
    status, details, md = st.to_status(exc)
    assert status == st.status_of(cls)
    back = st.from_status(status, details, md)
    assert type(back) is cls and str(back) == "boom"
    if cls is E.ResourceExhausted:
        assert back.retry_after == 1.5


def test_unlisted_subclass_uses_nearest_ancestor():
    class Later(E.CacheMiss):
        code = 999

    assert st.status_of(Later) == grpc.StatusCode.FAILED_PRECONDITION
    assert st.status_of(KeyError) == grpc.StatusCode.INTERNAL


def test_non_dgr_exception(caplog):
    """A remote caller learns nothing of an unexpected exception but a log reference; the
    log keeps it whole under that reference."""
    status, details, md = st.to_status(KeyError("/srv/models/secret.gguf"))
    assert status == grpc.StatusCode.INTERNAL and details.startswith("internal error")
    assert "secret" not in details and "KeyError" not in details
    ref = details.split("reference ")[1].split()[0]
    assert ref in caplog.text and "/srv/models/secret.gguf" in caplog.text
    assert type(st.from_status(status, details, md)) is E.DgrError
    # a dgr error's own message is meant for callers: it goes as it is
    assert st.to_status(E.CacheMiss("re-prefill"))[1] == "re-prefill"


@pytest.mark.parametrize("status,cls", [
    (grpc.StatusCode.UNAVAILABLE, E.WorkerUnavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, E.StepDeadlineExceeded),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, E.ResourceExhausted),
    (grpc.StatusCode.ABORTED, E.StaleEpoch),
    (grpc.StatusCode.PERMISSION_DENIED, E.DgrError),
])
def test_bare_status_without_trailer(status, cls):
    exc = st.from_status(status, "from grpc", None)
    assert type(exc) is cls and str(exc) == "from grpc"


def test_canonical_classes_map_back_to_their_status():
    for status, cls in st.CANONICAL.items():
        if status not in (grpc.StatusCode.CANCELLED,):
            assert st.status_of(cls) == status, (status, cls)


def test_garbage_trailer_is_ignored():
    exc = st.from_status(grpc.StatusCode.NOT_FOUND, "x", [("dgr-code", "nope"),
                                                           ("dgr-retry-after", "soon")])
    assert type(exc) is E.UnknownSession

