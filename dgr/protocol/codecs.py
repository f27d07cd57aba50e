"""Boundary payload codecs of the wire (docs/wire.md, "Payload"): raw f32, f16, bf16, q8, and
the zstd contexts that compress them. ``dgr.protocol.wire`` frames what these produce."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

from dgr.errors import FrameError, InvalidArgument, InvalidBoundary, UnknownCodec

__all__ = ["CODECS", "COMPRESSIONS", "DEFAULT_LEVEL", "payload_size", "encode_payload",
           "decode_payload", "cctx", "dctx", "F32"]

CODECS = ("raw", "f16", "bf16", "q8")
COMPRESSIONS = ("none", "zstd")
#: zstd level used when ``compress=True`` and no level is given.
DEFAULT_LEVEL = 3

F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")
_I8 = np.dtype("i1")
_tls = threading.local()  # zstd contexts are not thread-safe: one set per thread


def cctx(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    ctx = cache.get(level)
    if ctx is None:
        try:
            ctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        except (zstandard.ZstdError, TypeError, ValueError, OverflowError) as e:
            raise InvalidArgument(f"invalid zstd level {level!r}: {e}") from None
        cache[level] = ctx
    return ctx


def dctx() -> zstandard.ZstdDecompressor:
    ctx = getattr(_tls, "dctx", None)
    if ctx is None:
        ctx = _tls.dctx = zstandard.ZstdDecompressor()
    return ctx


def payload_size(codec: str, rows: int, cols: int) -> int:
    """Bytes of the uncompressed payload of a ``[rows, cols]`` array in ``codec``.

    Raises
    ------
    UnknownCodec
        ``codec`` is not one of ``CODECS``.
    """
    if codec == "raw":
        return 4 * rows * cols
    if codec == "f16" or codec == "bf16":
        return 2 * rows * cols
    if codec == "q8":
        return rows * (4 + cols)
    raise UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")


def _enc_f16(a: np.ndarray) -> np.ndarray:
    with np.errstate(over="raise", invalid="ignore"):
        try:
            return a.astype(_F16)
        except FloatingPointError:
            raise InvalidBoundary(
                "a finite value exceeds the f16 range (|x| > 65504); use raw or bf16"
            ) from None


def _enc_bf16(a: np.ndarray) -> np.ndarray:
    u = a.view(_U32)
    # Round to nearest, ties to even, on the upper 16 bits (uint32 arithmetic wraps).
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(_U16)
    nan = np.isnan(a)
    if nan.any():  # rounding may carry a NaN's payload into the sign or exponent
        out[nan] = ((u[nan] >> 16) & 0x8000) | 0x7FC0
    return out


def _enc_q8(a: np.ndarray) -> bytes:
    amax = np.max(np.abs(a), axis=1)
    if not np.isfinite(amax).all():
        raise InvalidBoundary("q8 needs finite values: a row holds inf or NaN; use raw")
    scale = (amax / np.float32(127.0)).astype(F32)  # may round to a subnormal or 0
    col = scale[:, None]
    # Divide (not multiply by 1/scale, which overflows for subnormal scales); rows whose
    # scale underflowed to 0 encode as 0.
    q = np.divide(a, col, out=np.zeros(a.shape, F32), where=col > 0)
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return b"".join((scale, q.astype(_I8)))


def encode_payload(a: np.ndarray, codec: str) -> Any:
    """The codec bytes of ``a`` as one buffer object (no copy for raw)."""
    if codec == "raw":
        return a
    if codec == "f16":
        return _enc_f16(a)
    if codec == "bf16":
        return _enc_bf16(a)
    if codec == "q8":
        return _enc_q8(a)
    raise UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")


def decode_payload(buf: Any, offset: int, codec: str, rows: int, cols: int) -> np.ndarray:
    n = rows * cols
    if codec == "raw":  # a view: read-only because decode's buffer is
        return np.ndarray((rows, cols), F32, buf, offset)
    if codec == "f16":
        arr = np.frombuffer(buf, _F16, n, offset).astype(F32).reshape(rows, cols)
    elif codec == "bf16":
        u = np.frombuffer(buf, _U16, n, offset).astype(_U32)
        arr = (u << 16).view(F32).reshape(rows, cols)
    else:  # q8
        scale = np.frombuffer(buf, F32, rows, offset)
        if not (scale >= 0).all() or not np.isfinite(scale).all():
            raise FrameError("q8 payload holds a negative or non-finite row scale")
        q = np.frombuffer(buf, _I8, n, offset + 4 * rows).reshape(rows, cols)
        arr = q.astype(F32)
        with np.errstate(over="ignore"):  # only a lying sender's scale can overflow
            arr *= scale[:, None]
    arr.flags.writeable = False
    return arr
