"""Typed errors of dgr: one class per failure a caller can act on."""

from __future__ import annotations

import sys

__all__ = [
    "DgrError",
    "ModelNotFound",
    "InvalidModel",
    "UnsupportedArchitecture",
    "InvalidLayerRange",
    "InvalidToken",
    "InvalidPosition",
    "ContextFull",
    "UnknownSlot",
    "InvalidBoundary",
    "MissingTokenIds",
    "MtpNotSupported",
    "InvalidArgument",
    "EngineError",
    "CoreNotBuilt",
    "CpuNotSupported",
    "DeviceNotFound",
    "DeviceOutOfMemory",
    "DeviceLost",
    "RollbackUnsupported",
    "FrameError",
    "FrameTruncated",
    "FrameTooLarge",
    "FrameChecksumError",
    "FrameVersionError",
    "UnknownCodec",
    "FrameNotNative",
    "SessionError",
    "StaleEpoch",
    "CacheMiss",
    "UnknownSession",
    "ResourceExhausted",
    "ModelMismatch",
    "RouteError",
    "RelayRefused",
    "Unauthenticated",
    "SessionForbidden",
    "WorkerUnavailable",
    "WorkerDraining",
    "StepDeadlineExceeded",
    "VendorError",
    "ModelFetchError",
    "ArtifactError",
    "ArtifactMissing",
    "ArtifactMismatch",
    "ArtifactTruncated",
    "InvalidManifest",
    "StorageLocationError",
    "ChatTemplateError",
    "ChatTemplateMissing",
]


class DgrError(Exception):
    """Base class of every error dgr raises on purpose.

    ``code`` is the stable numeric status shared with the C++ ``ShardEngine``
    (``cpp/include/dgr/status.h``); 0 is reserved for success.
    """

    code = 100


# --- engine (codes shared with cpp/include/dgr/status.h) ---------------------


class ModelNotFound(DgrError, FileNotFoundError):
    """The model path does not exist or cannot be read."""

    code = 1


class InvalidModel(DgrError, ValueError):
    """The file is not a GGUF model llama.cpp can load (bad magic, truncated, corrupt)."""

    code = 2


class UnsupportedArchitecture(DgrError, ValueError):
    """A partial layer range was asked of an architecture whose graph is not adapted."""

    code = 3


class InvalidLayerRange(DgrError, ValueError):
    """A layer range outside [0, n_layer), empty, or not held by the file."""

    code = 4


class InvalidToken(DgrError, ValueError):
    """A token id outside [0, n_vocab)."""

    code = 5


class InvalidPosition(DgrError, ValueError):
    """Positions that are not contiguous or do not continue the slot's sequence."""

    code = 6


class ContextFull(DgrError, RuntimeError):
    """The slot has no room left for the tokens of this step."""

    code = 7


class UnknownSlot(DgrError, LookupError):
    """A slot index outside [0, n_slots)."""

    code = 8

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidBoundary(DgrError, ValueError):
    """A boundary array of the wrong shape, dtype or presence for this stage."""

    code = 9


class MissingTokenIds(InvalidBoundary):
    """The stage owns a layer that routes by token id and got no token ids."""

    code = 10


class MtpNotSupported(DgrError, ValueError):
    """Multi-token prediction (MTP) was asked where it cannot run: a stage that is not the
    last, a model without a NextN block, an architecture dgr does not draft for, or
    ``mtp_draft`` on an engine loaded without ``mtp``."""

    code = 11


class InvalidArgument(DgrError, ValueError):
    """Any other bad argument (settings, shapes, types)."""

    code = 12


class EngineError(DgrError, RuntimeError):
    """llama.cpp failed for a reason that is not the caller's input."""

    code = 13


class CoreNotBuilt(DgrError, ImportError):
    """The compiled core ``dgr._core`` is missing; build it with ``pip install -e .``."""

    code = 14


class CpuNotSupported(CoreNotBuilt):
    """The compiled core was built for CPUs with instruction sets this one lacks (a portable
    ``x86-64-v3`` wheel on a CPU without AVX2): the message names them and how to build for
    this CPU from source."""

    code = 60


class DeviceNotFound(DgrError, LookupError):
    """The compute device asked for is not one this process can use: no such device, or a
    backend this binary was not built with (``python -m dgr devices`` lists the usable ones)."""

    code = 16


class DeviceOutOfMemory(DgrError, MemoryError):
    """The layer range (weights, KV cache, compute buffers) does not fit the device's free
    memory or the cap set on it; the message says how much it needs and how much is free."""

    code = 17


# --- wire ---------------------------------------------------------------------


class FrameError(DgrError, ValueError):
    """A wire frame that cannot be decoded or fails validation."""

    code = 20


class FrameTruncated(FrameError):
    """The frame is shorter than its prefix, header or payload claim."""

    code = 21


class FrameTooLarge(FrameError):
    """The frame's payload exceeds the receiver's configured maximum."""

    code = 22


class FrameChecksumError(FrameError):
    """The payload checksum does not match."""

    code = 23


class FrameVersionError(FrameError):
    """The frame's format or schema version is newer than this build supports."""

    code = 24


class UnknownCodec(FrameError):
    """The frame names a dtype or codec this build does not know."""

    code = 25


class FrameNotNative(FrameError):
    """Not an error on the wire: the C++ frame decoder (``dgr._core._frame``) checked the frame
    up to its payload checksum but decodes only the raw codec without compression; decode this
    one with ``dgr.protocol.wire.decode``. Never sent to a peer."""

    code = 26


# --- sessions and routes --------------------------------------------------------


class SessionError(DgrError):
    """A request that does not fit the worker's session state."""

    code = 30


class StaleEpoch(SessionError, ValueError):
    """The request's epoch is lower than the session's current epoch."""

    code = 31


class CacheMiss(SessionError, LookupError):
    """The worker's cache does not continue at the request's first position: re-prefill."""

    code = 32

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RollbackUnsupported(CacheMiss):
    """A stage's cache cannot drop the tail a step rolls back (rejected speculative drafts);
    the stage cleared the session's slot: re-prefill."""

    code = 15


class UnknownSession(SessionError, LookupError):
    """The worker holds no state for this session."""

    code = 33

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(SessionError, RuntimeError):
    """No slot or context is free; ``retry_after`` says when to try again (seconds)."""

    code = 34

    def __init__(self, message: str = "", retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ModelMismatch(DgrError, ValueError):
    """A frame or route names a model identity or numeric settings this worker does not serve."""

    code = 35


class RouteError(DgrError, ValueError):
    """A route whose stages do not cover [0, n_layer) exactly once, in order."""

    code = 36


class RelayRefused(RouteError, PermissionError):
    """A frame names a relay or loop endpoint this worker may not connect to (its relay
    allowlist, ``python -m dgr.worker --relay-allow``); no connection was attempted."""

    code = 41


class Unauthenticated(DgrError, PermissionError):
    """The caller presented no cluster credential, or one this worker does not accept (wrong,
    expired, replayed); the message never says which (docs/security.md)."""

    code = 42


class SessionForbidden(SessionError, PermissionError):
    """A step or release names a session that another credential opened on this worker."""

    code = 43


class WorkerUnavailable(DgrError, ConnectionError):
    """The worker cannot be reached or went away mid-step."""

    code = 37


class WorkerDraining(WorkerUnavailable):
    """The worker is shutting down and takes no new sessions."""

    code = 38


class DeviceLost(WorkerUnavailable, RuntimeError):
    """The stage's compute device failed mid-run (lost, reset, a kernel fault): every slot of
    its engine is gone and it computes nothing more. A route fails over to a spare, as for a
    worker that went away."""

    code = 18


class StepDeadlineExceeded(DgrError, TimeoutError):
    """A step did not complete within its deadline."""

    code = 39


class NoHealthyWorker(WorkerUnavailable):
    """Recovery found no healthy worker for a layer range (the message names the range)."""

    code = 40


# --- build and artifacts ----------------------------------------------------------


class VendorError(DgrError, RuntimeError):
    """Fetching, patching or building the pinned llama.cpp failed."""

    code = 50


class ModelFetchError(DgrError, RuntimeError):
    """A registry model could not be downloaded or verified."""

    code = 51


class ArtifactError(DgrError, RuntimeError):
    """Model artifacts do not match their manifest (``problems`` lists every finding)."""

    code = 52

    def __init__(self, message: str = "", problems: list | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


class ArtifactMissing(ArtifactError, FileNotFoundError):
    """A file the manifest lists (e.g. one split of a split model) is not there."""

    code = 53

    def __str__(self) -> str:  # FileNotFoundError would format (errno, strerror)
        return str(self.args[0]) if self.args else ""


class ArtifactMismatch(ArtifactError, ValueError):
    """A file, header or tensor whose bytes differ from the manifest's hashes."""

    code = 54


class ArtifactTruncated(ArtifactMismatch):
    """A file shorter than the manifest says (tensors cut off)."""

    code = 55


class InvalidManifest(ArtifactError, ValueError):
    """A manifest that cannot be read, has an unknown schema, or does not describe this model."""

    code = 56


class StorageLocationError(DgrError, ValueError):
    """A production artifact (or an explicit artifact store) asked for under ``/home``, where no
    model artifact may be placed; the message says where to put it instead."""

    code = 57


# --- serving ------------------------------------------------------------------------


class ChatTemplateError(DgrError, ValueError):
    """A model's chat template failed to render (syntax error, ``raise_exception``, an unsafe
    attribute the sandbox refused, an undefined value); the message is the template's own."""

    code = 58


class ChatTemplateMissing(ChatTemplateError):
    """The model's GGUF carries no ``tokenizer.chat_template``, so chat messages cannot be
    turned into a prompt."""

    code = 59


def all_classes() -> list[type[DgrError]]:
    """``DgrError`` and every subclass defined so far (depth first)."""
    seen: list[type[DgrError]] = []
    todo = [DgrError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


BY_CODE: dict[int, type[DgrError]] = {}
for _cls in all_classes():
    BY_CODE.setdefault(_cls.code, _cls)
del _cls


def public_message(exc: BaseException) -> str:
    """What a remote caller is told of ``exc``: a dgr error's own message (written for
    callers: it names no path or internals); any other exception only as an internal error
    with a reference, while the process log keeps the whole exception under that
    reference."""
    if isinstance(exc, DgrError):
        return str(exc) or type(exc).__name__
    import logging
    import secrets

    ref = secrets.token_hex(4)
    logging.getLogger("dgr").error("internal error %s: %s: %s", ref, type(exc).__name__, exc,
                                   exc_info=exc)
    return f"internal error (reference {ref} in the worker's log)"


def from_code(code: int, message: str) -> DgrError:
    """Build the error class registered for ``code`` (``DgrError`` when unknown)."""
    return BY_CODE.get(code, DgrError)(message)


def report(e: DgrError) -> int:
    """What every command does with a DgrError it stops on: one line on stderr naming the
    error's class and message; returns the exit status, 2."""
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return 2
