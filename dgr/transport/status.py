"""The one table between ``dgr.errors`` classes and gRPC status codes, both ways."""

from __future__ import annotations

import grpc

from dgr import errors as E

__all__ = ["STATUS_OF", "CANONICAL", "CODE_KEY", "RETRY_KEY", "status_of", "to_status",
           "from_status", "from_rpc_error"]

S = grpc.StatusCode

#: Trailing-metadata keys that carry the exact dgr error across a gRPC status.
CODE_KEY = "dgr-code"
RETRY_KEY = "dgr-retry-after"

#: Each dgr error class -> the one gRPC status it travels as. A class that is not listed
#: (added later) travels as its nearest listed ancestor's status; the exact class still
#: travels in the ``dgr-code`` trailer.
STATUS_OF: dict[type[E.DgrError], grpc.StatusCode] = {
    E.DgrError: S.UNKNOWN,
    # engine
    E.ModelNotFound: S.NOT_FOUND,
    E.InvalidModel: S.FAILED_PRECONDITION,
    E.UnsupportedArchitecture: S.UNIMPLEMENTED,
    E.InvalidLayerRange: S.INVALID_ARGUMENT,
    E.InvalidToken: S.INVALID_ARGUMENT,
    E.InvalidPosition: S.INVALID_ARGUMENT,
    E.ContextFull: S.OUT_OF_RANGE,
    E.UnknownSlot: S.NOT_FOUND,
    E.InvalidBoundary: S.INVALID_ARGUMENT,
    E.MissingTokenIds: S.INVALID_ARGUMENT,
    E.MtpNotSupported: S.UNIMPLEMENTED,
    E.InvalidArgument: S.INVALID_ARGUMENT,
    E.EngineError: S.INTERNAL,
    E.CoreNotBuilt: S.INTERNAL,
    E.DeviceNotFound: S.FAILED_PRECONDITION,
    E.DeviceOutOfMemory: S.RESOURCE_EXHAUSTED,
    E.DeviceLost: S.UNAVAILABLE,           # the stage is gone: fail over to a spare
    # wire
    E.FrameError: S.INVALID_ARGUMENT,
    E.FrameTruncated: S.DATA_LOSS,
    E.FrameTooLarge: S.INVALID_ARGUMENT,  # not RESOURCE_EXHAUSTED: retrying will not help
    E.FrameChecksumError: S.DATA_LOSS,
    E.FrameVersionError: S.UNIMPLEMENTED,
    E.UnknownCodec: S.UNIMPLEMENTED,
    # sessions and routes
    E.SessionError: S.FAILED_PRECONDITION,
    E.StaleEpoch: S.ABORTED,               # a sequencer check failed: a newer epoch exists
    E.CacheMiss: S.FAILED_PRECONDITION,    # re-prefill, then retry
    E.RollbackUnsupported: S.FAILED_PRECONDITION,
    E.UnknownSession: S.NOT_FOUND,
    E.ResourceExhausted: S.RESOURCE_EXHAUSTED,
    E.ModelMismatch: S.FAILED_PRECONDITION,
    E.RouteError: S.FAILED_PRECONDITION,
    E.RelayRefused: S.PERMISSION_DENIED,
    E.Unauthenticated: S.UNAUTHENTICATED,
    E.SessionForbidden: S.PERMISSION_DENIED,
    E.WorkerUnavailable: S.UNAVAILABLE,
    E.WorkerDraining: S.UNAVAILABLE,
    E.StepDeadlineExceeded: S.DEADLINE_EXCEEDED,
    # build and artifacts
    E.VendorError: S.INTERNAL,
    E.ModelFetchError: S.UNAVAILABLE,
}

#: gRPC status -> the dgr class it means when no ``dgr-code`` trailer says more (a status
#: from gRPC itself, a proxy, or a peer that is not dgr). Codes not listed give ``DgrError``.
CANONICAL: dict[grpc.StatusCode, type[E.DgrError]] = {
    S.INVALID_ARGUMENT: E.InvalidArgument,
    S.OUT_OF_RANGE: E.ContextFull,
    S.NOT_FOUND: E.UnknownSession,
    S.FAILED_PRECONDITION: E.SessionError,
    S.ABORTED: E.StaleEpoch,
    S.RESOURCE_EXHAUSTED: E.ResourceExhausted,
    S.UNAVAILABLE: E.WorkerUnavailable,
    S.DEADLINE_EXCEEDED: E.StepDeadlineExceeded,
    S.CANCELLED: E.WorkerUnavailable,
    S.DATA_LOSS: E.FrameChecksumError,
    S.UNIMPLEMENTED: E.UnknownCodec,
    S.INTERNAL: E.EngineError,
    S.UNKNOWN: E.DgrError,
    S.UNAUTHENTICATED: E.Unauthenticated,
}


def status_of(cls: type[BaseException]) -> grpc.StatusCode:
    """The gRPC status of an exception class (nearest listed ancestor; INTERNAL if not dgr)."""
    for k in cls.__mro__:
        s = STATUS_OF.get(k)
        if s is not None:
            return s
    return S.INTERNAL


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status, details, trailing metadata) that carry ``exc`` over gRPC."""
    code = exc.code if isinstance(exc, E.DgrError) else E.DgrError.code
    md = [(CODE_KEY, str(code))]
    retry = getattr(exc, "retry_after", None)
    if retry is not None:
        md.append((RETRY_KEY, repr(float(retry))))
    return status_of(type(exc)), E.public_message(exc), tuple(md)


def from_status(status: grpc.StatusCode, details: str | None,
                metadata=None) -> E.DgrError:
    """The dgr exception a gRPC status means (exact when the ``dgr-code`` trailer is there)."""
    code = retry = None
    for k, v in metadata or ():
        if k == CODE_KEY:
            try:
                code = int(v)
            except ValueError:
                pass
        elif k == RETRY_KEY:
            try:
                retry = float(v)
            except ValueError:
                pass
    msg = details or status.name
    if code is not None and code in E.BY_CODE:
        exc = E.BY_CODE[code](msg)
    elif status == S.RESOURCE_EXHAUSTED and "larger than max" in msg:
        # gRPC's own message size limit: retrying will not help
        exc = E.FrameTooLarge(msg)
    else:
        exc = CANONICAL.get(status, E.DgrError)(msg)
    if retry is not None and hasattr(exc, "retry_after"):
        exc.retry_after = retry
    return exc


def from_rpc_error(err: grpc.RpcError, what: str = "") -> E.DgrError:
    """Translate a ``grpc.RpcError`` (sync or aio) raised by a call to ``what``."""
    try:
        status, details, md = err.code(), err.details(), err.trailing_metadata()
    except Exception:  # noqa: BLE001 - a half-built error object still means "unreachable"
        status, details, md = S.UNAVAILABLE, str(err), None
    exc = from_status(status, details, md)
    if what and isinstance(exc, (E.WorkerUnavailable, E.StepDeadlineExceeded)):
        exc.args = (f"{what}: {exc.args[0] if exc.args else status.name}",)
    return exc
