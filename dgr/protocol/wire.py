"""Typed, validated, cheap frames for boundaries, results and errors (spec: docs/wire.md)."""

from __future__ import annotations

import re
import struct
from typing import Annotated, Any, Union

import msgspec
import numpy as np
import xxhash
import zstandard

from dgr.errors import (
    DgrError,
    FrameChecksumError,
    FrameError,
    FrameTooLarge,
    FrameTruncated,
    FrameVersionError,
    InvalidArgument,
    InvalidBoundary,
    UnknownCodec,
    from_code,
    public_message,
)
from dgr.protocol.codecs import (
    CODECS,
    COMPRESSIONS,
    DEFAULT_LEVEL,
    F32,
    cctx,
    dctx,
    decode_payload,
    encode_payload,
    payload_size,
)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "SCHEMA_VERSION",
    "MEDIA",
    "MROPE_SECTIONS",
    "span",
    "PREFIX_SIZE",
    "PAYLOAD_ALIGN",
    "MAX_PAYLOAD",
    "MAX_HEADER",
    "DEFAULT_LEVEL",
    "CODECS",
    "COMPRESSIONS",
    "WANTS",
    "DRAFTERS",
    "MAX_DRAFT",
    "RESULT_KINDS",
    "Sampling",
    "Hop",
    "Forward",
    "Result",
    "ErrorReply",
    "Hello",
    "Message",
    "Frame",
    "encode",
    "encode_into",
    "decode",
    "payload_size",
]

# --- constants (docs/wire.md, "Prefix") -----------------------------------------

MAGIC = b"DGRF"
#: Incompatible changes (prefix, payload layouts, checksum, field meaning) bump this.
FORMAT_VERSION = 1
#: Compatible changes (a field appended with a default, a field retired) bump this.
#: 2: ``Forward.relay`` / ``reply_to`` / ``loop`` / ``steps`` / ``stop_tokens`` and the
#: ``Hello`` message (direct relay, decode loop).
#: 3: ``Forward.streams`` and ``Result.streams`` retired (always 1: the width alone is the
#: boundary's); their slots stay, reserved (``_reserved``), so no other field moves.
#: 4: speculative decoding: ``Forward.rollback`` / ``drafts`` / ``speculate`` /
#: ``max_draft`` and ``Result.drafted`` (docs/speculative.md).
#: 5: ``Sampling.min_p`` / ``bias_ids`` / ``bias`` (min-p and logit bias) and
#: ``penalty_last_n`` / ``repeat_penalty`` / ``frequency_penalty`` / ``presence_penalty``,
#: and ``grammar`` / ``grammar_id`` / ``grammar_from`` (constrained decoding).
#: 6: media steps: ``Forward.media`` / ``sections`` / ``causal`` (docs/media.md).
SCHEMA_VERSION = 6
#: magic[4] version:u8 flags:u8 reserved:u16 header_len:u32 header_sum:u32, little endian.
_PREFIX = struct.Struct("<4sBBHII")
PREFIX_SIZE = _PREFIX.size  # 16
#: The payload starts at the first multiple of this after the header (cache line, AVX-512).
PAYLOAD_ALIGN = 64
_KNOWN_FLAGS = 0  # no flag bits are defined in format version 1
#: Default receiver limits (bytes); both are per-call keywords of ``decode``.
MAX_PAYLOAD = 256 << 20
MAX_HEADER = 1 << 20

WANTS = ("boundary", "logits", "token", "token+logits", "embedding")
#: the last stage's drafters (``Forward.speculate``; "" is none)
DRAFTERS = ("", "ngram", "mtp")
#: the most drafts one step may carry (``Forward.max_draft``)
MAX_DRAFT = 32
#: a media step's kind (``Forward.media``; "" is a step of token ids or a text boundary)
MEDIA = ("", "image", "audio")
#: positions per row of an M-RoPE media step (``Forward.sections``: t, y, x, z)
MROPE_SECTIONS = 4
RESULT_KINDS = ("none", "boundary", "logits", "embedding")
_DTYPES = ("f32",)

_I32_MAX = 2**31 - 1
_I64_MAX = 2**63 - 1
_ZPAD = bytes(PAYLOAD_ALIGN)

# --- messages (docs/wire.md, "Header") ------------------------------------------
# Append-only: a new field goes at the END of its struct, with a default, and bumps
# SCHEMA_VERSION; anything else bumps FORMAT_VERSION. array_like: encoded as a msgpack
# array [tag, field0, field1, ...]; receivers ignore trailing items they do not know. A field
# is decoded by its position, not its name: a retired one keeps its slot (``_reserved``:
# senders write 1, receivers check its type only), or every later field would shift.

_NonNeg32 = Annotated[int, msgspec.Meta(ge=0, le=_I32_MAX)]
_Positive32 = Annotated[int, msgspec.Meta(ge=1, le=_I32_MAX)]
_NonNeg63 = Annotated[int, msgspec.Meta(ge=0, le=_I64_MAX)]
_UInt64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack itself caps ints at 2**64 - 1
_Schema = Annotated[int, msgspec.Meta(ge=1)]
_DBL_MAX = 1.7976931348623157e308
_Finite = Annotated[float, msgspec.Meta(ge=-_DBL_MAX, le=_DBL_MAX)]  # not inf, not NaN


class Sampling(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """How the last stage picks a token (``Forward.sampling``; ``None`` there means greedy).

    ``greedy`` overrides the rest; ``top_k=0``, ``top_p=1.0`` and ``min_p=0.0`` switch those
    filters off. ``bias[i]`` is added to the logit of token ``bias_ids[i]`` before anything
    else (greedy included), as llama.cpp's logit-bias sampler does; then the penalties over
    the session's last ``penalty_last_n`` tokens (0: none), as llama.cpp's penalties sampler
    (``dgr.protocol.sampling.SamplingParams``; the last stage keeps the session's tokens).
    ``grammar_id`` nonzero: the tokens from position ``grammar_from`` on follow the grammar
    ``grammar`` (llguidance's definition, ``dgr.protocol.grammar``; the last stage keeps its
    state per session, so a step may name it by id alone once the stage has its text).
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_k: _NonNeg32 = 0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: _UInt64 = 0
    greedy: bool = False
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    bias_ids: tuple[_NonNeg32, ...] = ()
    bias: tuple[Annotated[float, msgspec.Meta(le=_DBL_MAX)], ...] = ()  # -inf bans
    penalty_last_n: _NonNeg32 = 0
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=_DBL_MAX)] = 1.0
    frequency_penalty: _Finite = 0.0
    presence_penalty: _Finite = 0.0
    grammar: str = ""
    grammar_id: _UInt64 = 0
    grammar_from: _NonNeg32 = 0

    def __post_init__(self):
        if len(self.bias_ids) != len(self.bias):
            raise ValueError(f"Sampling has {len(self.bias_ids)} bias_ids and {len(self.bias)} "
                             f"bias values")


class Hop(msgspec.Struct, frozen=True, array_like=True, kw_only=True):
    """A stage further down a relayed route (``Forward.relay``).

    ``endpoint`` is the stage's data-plane ``host:port``; ``tokens`` says whether the frame
    sent to it must carry the token ids (its range routes by token id).
    """

    endpoint: str
    tokens: bool = False


class Forward(msgspec.Struct, tag=1, array_like=True, frozen=True, kw_only=True):
    """A step request: run layers from ``layer`` on ``n_tokens`` tokens of ``session``.

    The optional array is the boundary ``[n_tokens, width]`` (``width``: the receiving
    stage's boundary width); ``width == 0`` means no boundary (first stage: ``tokens``
    only). ``encode`` fills ``width``, ``dtype``, ``codec``, ``compression``,
    ``payload_len`` and ``checksum``.
    ``rows`` picks the batch rows whose logits or token the receiver returns (``None``:
    the last row).
    """

    schema: _Schema = SCHEMA_VERSION
    model: str
    session: str
    epoch: _NonNeg63
    first_pos: _NonNeg32
    n_tokens: _Positive32
    layer: _NonNeg32
    width: _NonNeg32 = 0
    _reserved: _Positive32 = 1  # schema <= 2: streams, always 1
    dtype: str = "f32"
    codec: str = "raw"
    compression: str = "none"
    payload_len: _NonNeg63 = 0
    checksum: _UInt64 = 0
    positions: Union[list[_NonNeg32], None] = None
    tokens: Union[list[_NonNeg32], None] = None
    want: str = "boundary"
    rows: Union[list[_NonNeg32], None] = None
    sampling: Union[Sampling, None] = None
    relay: Union[list[Hop], None] = None
    reply_to: str = ""
    loop: Union[list[Hop], None] = None
    steps: _NonNeg32 = 0
    stop_tokens: Union[list[_NonNeg32], None] = None
    #: compute this step alone, never in one forward with other sessions' steps (the
    #: route's parity mode: a batched row may differ in its last bits from the row alone)
    solo: bool = False
    #: positions the session's cache drops before this step runs (rejected drafts of the
    #: step before): the step starts at ``rollback`` positions before the cache's end
    rollback: _NonNeg32 = 0
    #: the last ``drafts`` tokens are unverified drafts: the last stage samples the
    #: ``drafts + 1`` rows from the one before them and accepts the longest prefix of drafts
    #: that matches (``Result.drafted``)
    drafts: _NonNeg32 = 0
    #: the decode loop's drafter on the last stage (``DRAFTERS``: "" none, "ngram", "mtp")
    speculate: str = ""
    #: at most this many drafts per step of the loop (``MAX_DRAFT`` at most)
    max_draft: _NonNeg32 = 0
    #: a media step (``MEDIA``: "image", "audio"): the array is the rows of an encoded
    #: media chunk (``dgr.Media``): on the first stage its embedding rows (the stage's
    #: ``n_embd_inp`` wide), on the others the boundary; no token ids
    media: str = ""
    #: an M-RoPE media step's positions, ``MROPE_SECTIONS`` per row, section-major
    #: (``sections[j * n_tokens + i]``: mtmd's t, y, x, z; ``sections[0] == first_pos``);
    #: None: the rows' positions are ``positions`` (or consecutive from ``first_pos``)
    sections: Union[list[_NonNeg32], None] = None
    #: False: the media step's rows attend to each other both ways (on every stage)
    causal: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        """The array shape this header announces (``(n_tokens, 0)`` when it has none)."""
        return (self.n_tokens, self.width)


class Result(msgspec.Struct, tag=2, array_like=True, frozen=True, kw_only=True):
    """The reply to a ``Forward``: a boundary for the next stage, logits rows and/or tokens.

    ``kind`` names the array: ``"boundary"`` (``[n_tokens, width]``, ``layer`` = the next
    layer to run), ``"logits"`` (``[len(rows), n_vocab]``) or ``"none"``. ``tokens`` are
    the sampled token ids, one per wanted row. ``encode`` fills ``rows``/``cols`` and the
    payload fields.
    """

    schema: _Schema = SCHEMA_VERSION
    session: str
    epoch: _NonNeg63
    first_pos: _NonNeg32
    n_tokens: _NonNeg32
    kind: str = "none"
    layer: _NonNeg32 = 0
    rows: _NonNeg32 = 0
    cols: _NonNeg32 = 0
    _reserved: _Positive32 = 1  # schema <= 2: streams, always 1
    dtype: str = "f32"
    codec: str = "raw"
    compression: str = "none"
    payload_len: _NonNeg63 = 0
    checksum: _UInt64 = 0
    tokens: Union[list[_NonNeg32], None] = None
    #: drafts the step verified (``Forward.drafts``): ``tokens`` are the accepted drafts and
    #: the token sampled after them, cut after a stop token
    drafted: _NonNeg32 = 0

    @property
    def shape(self) -> tuple[int, int]:
        """The array shape this header announces (``(0, 0)`` when it has none)."""
        return (self.rows, self.cols)


class ErrorReply(msgspec.Struct, tag=3, array_like=True, frozen=True, kw_only=True):
    """A failed step: ``code`` is a ``dgr.errors`` code; never carries a payload."""

    schema: _Schema = SCHEMA_VERSION
    code: _NonNeg32
    message: str
    session: str = ""
    epoch: _NonNeg63 = 0
    retry_after: Union[Annotated[float, msgspec.Meta(ge=0.0)], None] = None

    @classmethod
    def from_exception(cls, exc: BaseException, *, session: str = "", epoch: int = 0) -> ErrorReply:
        """Describe ``exc``; a non-dgr exception becomes code ``DgrError.code`` (100) and an
        internal error with a log reference (``dgr.errors.public_message``)."""
        code = exc.code if isinstance(exc, DgrError) else DgrError.code
        retry = getattr(exc, "retry_after", None)
        msg = public_message(exc)
        return cls(code=code, message=msg, session=session, epoch=epoch, retry_after=retry)

    def to_exception(self) -> DgrError:
        """The ``dgr.errors`` exception registered for ``code`` (``DgrError`` when unknown)."""
        exc = from_code(self.code, self.message)
        if self.retry_after is not None and hasattr(exc, "retry_after"):
            exc.retry_after = self.retry_after
        return exc


class Hello(msgspec.Struct, tag=4, array_like=True, frozen=True, kw_only=True):
    """First frame a driver sends on a data-plane connection (docs/dataplane.md).

    ``route`` names the connection as a return path: the worker sends the ``Result`` of a
    relayed step whose ``Forward.reply_to`` equals it (last stage), and any ``ErrorReply``
    for such a step, back on this connection. Never carries a payload.
    """

    schema: _Schema = SCHEMA_VERSION
    route: str = ""


Message = Union[Forward, Result, ErrorReply, Hello]
_BY_TAG = {1: Forward, 2: Result, 3: ErrorReply, 4: Hello}


class Frame(msgspec.Struct, frozen=True, eq=False):
    """A decoded frame: the validated header and its array (``None`` when it has none).

    For the raw codec without compression ``array`` is a read-only view over the buffer
    given to ``decode`` (keep that buffer alive and unmodified while you use it).
    """

    header: Message
    array: Any = None


# --- module-level msgpack codecs ------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


# --- header semantics, shared by encode and decode ------------------------------


def span(h: Forward) -> int:
    """How many positions step ``h`` advances its session by: its rows, or an M-RoPE media
    step's highest position + 1 less its first (an image's rows share their t position and
    its (y, x) go further: mtmd's ``n_pos``)."""
    if h.sections is None:
        return h.n_tokens
    return max(h.sections) + 1 - h.first_pos


def _check_forward(h: Forward) -> str | None:
    n = h.n_tokens
    if n < 1:
        return f"Forward.n_tokens must be >= 1 (zero-token steps are rejected), got {n}"
    if h.positions is not None:
        if len(h.positions) != n:
            return f"Forward.positions has {len(h.positions)} entries but n_tokens is {n}"
        if h.positions[0] != h.first_pos:
            return f"Forward.positions[0] is {h.positions[0]} but first_pos is {h.first_pos}"
    elif h.first_pos + n - 1 > _I32_MAX:
        return f"Forward.first_pos {h.first_pos} + n_tokens {n} overflows int32 positions"
    if h.tokens is not None and len(h.tokens) != n:
        return f"Forward.tokens has {len(h.tokens)} ids but n_tokens is {n}"
    if h.width == 0 and h.tokens is None:
        return "Forward carries neither a boundary (width is 0) nor token ids"
    if h.want not in WANTS:
        return f"unknown Forward.want {h.want!r} (known: {', '.join(WANTS)})"
    if h.rows is not None:
        if h.want == "embedding":
            return "Forward.want 'embedding' returns every row: rows must be None"
        if not h.rows:
            return "Forward.rows is empty (use None for the last row)"
        if max(h.rows) >= n:
            return f"Forward.rows names row {max(h.rows)} but n_tokens is {n}"
    if h.relay is not None and not h.reply_to:
        return "Forward.relay is set but reply_to is empty (where would the result go?)"
    if h.steps > 1:
        if not h.loop or not h.reply_to:
            return f"Forward.steps is {h.steps} but loop or reply_to is empty"
        if not h.want.startswith("token"):
            return f"Forward.steps is {h.steps} but want is {h.want!r} (a loop feeds tokens)"
        if h.rows is not None:
            return "Forward.steps > 1 continues from the last row: rows must be None"
    if h.drafts:
        if h.drafts >= n:
            return f"Forward.drafts is {h.drafts} but n_tokens is {n} (a draft follows a token)"
        if not h.want.startswith("token") or h.rows is not None:
            return "Forward.drafts asks the last stage to verify: want a token, rows None"
    if h.speculate not in DRAFTERS:
        return f"unknown Forward.speculate {h.speculate!r} (known: ngram, mtp)"
    if h.max_draft > MAX_DRAFT or h.drafts > MAX_DRAFT:
        return f"Forward.max_draft / drafts may be at most {MAX_DRAFT}"
    if h.media not in MEDIA:
        return f"unknown Forward.media {h.media!r} (known: image, audio)"
    if h.media:
        if h.width == 0 or h.tokens is not None:
            return "Forward.media carries rows (width > 0) and no token ids"
        if h.steps > 1 or h.drafts:
            return "a Forward.media step is one step of prompt rows: no loop, no drafts"
    elif h.sections is not None or not h.causal:
        return "Forward.sections and causal=False are a media step's (Forward.media)"
    if h.sections is not None:
        if len(h.sections) != MROPE_SECTIONS * n:
            return (f"Forward.sections has {len(h.sections)} entries but n_tokens is {n} "
                    f"({MROPE_SECTIONS} per row)")
        if h.sections[0] != h.first_pos:
            return f"Forward.sections[0] is {h.sections[0]} but first_pos is {h.first_pos}"
        if h.positions is not None:
            return "Forward.sections replaces positions: one of them"
    return None


def _check_result(h: Result) -> str | None:
    if h.kind not in RESULT_KINDS:
        return f"unknown Result.kind {h.kind!r} (known: {', '.join(RESULT_KINDS)})"
    if h.kind == "none":
        if h.rows or h.cols:
            return f"Result.kind is 'none' but rows x cols is {h.rows} x {h.cols}"
    else:
        if not h.rows or not h.cols:
            return f"Result.kind is {h.kind!r} but rows x cols is {h.rows} x {h.cols}"
    return None


_PATH = re.compile(r"`\$\[(\d+)\](?:\[(\d+)\])?`")


def _explain(msg: str, hbytes: Any) -> str:
    """Name the field behind msgspec's ``$[i]`` path (cold path, best effort)."""
    m = _PATH.search(msg)
    if m is None:
        return msg
    try:
        raw = msgspec.msgpack.decode(hbytes)
        cls = _BY_TAG[raw[0]]
        name = f"{cls.__name__}.{cls.__struct_fields__[int(m.group(1)) - 1]}"
        if m.group(2) is not None and name == "Forward.sampling":
            name += f".{Sampling.__struct_fields__[int(m.group(2))]}"
    except Exception:  # noqa: BLE001 - only decorates an error message
        return msg
    return f"{msg} ({name})"


# --- encode ---------------------------------------------------------------------


def _prepare(
    header: Message, array: Any, codec: str, compress: bool, level: int | None
) -> tuple[Message, Any]:
    """Validate, encode the payload and fill the header's payload fields."""
    cls = type(header)
    if array is None:
        if cls is Forward:
            if header.width:
                raise InvalidBoundary(f"Forward.width is {header.width} but no array was given")
        elif cls is Result:
            if header.rows or header.cols:
                raise InvalidBoundary(
                    f"Result.rows x cols is {header.rows} x {header.cols} but no array was given"
                )
        elif cls is not ErrorReply and cls is not Hello:
            raise InvalidArgument(f"cannot encode {cls.__name__}: not a dgr wire message")
        err = _check_forward(header) if cls is Forward else _check_result(header) if cls is Result else None
        if err:
            raise InvalidArgument(err)
        if cls is ErrorReply or cls is Hello:
            return header, b""
        return (
            msgspec.structs.replace(
                header, dtype="f32", codec="raw", compression="none", payload_len=0, checksum=_EMPTY_SUM
            ),
            b"",
        )

    if type(array) is not np.ndarray:
        raise InvalidBoundary(f"array must be a numpy.ndarray, got {type(array).__name__}")
    dt = array.dtype
    if dt is not F32 and dt != F32:
        if dt.kind != "f" or dt.itemsize != 4:
            raise InvalidBoundary(f"array dtype must be float32, got {dt}")
        array = array.astype(F32)  # big-endian float32: the wire is little endian
    if array.ndim != 2:
        raise InvalidBoundary(f"array must be 2-D [rows, width], got shape {array.shape}")
    rows, cols = array.shape
    if cls is Forward:
        if rows != header.n_tokens:
            raise InvalidBoundary(f"array has {rows} rows but Forward.n_tokens is {header.n_tokens}")
        if header.width and header.width != cols:
            raise InvalidBoundary(f"array has width {cols} but Forward.width is {header.width}")
        if cols == 0:
            raise InvalidBoundary("array has width 0")
    elif cls is Result:
        if header.kind == "none":
            raise InvalidArgument("Result.kind must be 'boundary', 'logits' or 'embedding' when "
                                  "an array is sent")
        if rows == 0 or cols == 0:
            raise InvalidBoundary(f"array shape {array.shape} is empty")
    else:
        raise InvalidArgument(f"{cls.__name__} carries no array")

    payload = array if codec == "raw" else encode_payload(array, codec)
    comp = "none"
    zc = None
    if compress:
        zc = cctx(DEFAULT_LEVEL if level is None else level)
        comp = "zstd"
    try:  # the raw codec compresses or hashes (and later copies) the caller's array itself
        if zc is not None:
            payload = zc.compress(payload)
        csum = xxhash.xxh3_64_intdigest(payload)
    except zstandard.ZstdError as e:
        raise InvalidArgument(f"zstd compression failed: {e}") from None
    except (BufferError, ValueError, TypeError):
        raise InvalidBoundary("array must be C-contiguous for the raw codec") from None
    plen = payload.nbytes if type(payload) is np.ndarray else len(payload)
    if cls is Forward:
        header = msgspec.structs.replace(
            header, width=cols, dtype="f32", codec=codec, compression=comp, payload_len=plen, checksum=csum
        )
        err = _check_forward(header)
    else:
        header = msgspec.structs.replace(
            header, rows=rows, cols=cols, dtype="f32", codec=codec, compression=comp,
            payload_len=plen, checksum=csum,
        )
        err = _check_result(header)
    if err:
        raise InvalidArgument(err)
    return header, payload


_EMPTY_SUM = xxhash.xxh3_64_intdigest(b"")


def _head(header: Message) -> tuple[bytes, bytes]:
    """(prefix, header bytes + zero padding up to the payload offset)."""
    try:
        hb = _ENCODER.encode(header)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise InvalidArgument(f"cannot encode {type(header).__name__}: {e}") from None
    hlen = len(hb)
    pad = -(PREFIX_SIZE + hlen) % PAYLOAD_ALIGN
    if pad:
        hb += _ZPAD[:pad]
    hsum = xxhash.xxh3_64_intdigest(hb) & 0xFFFFFFFF
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, hlen, hsum), hb


def encode(
    header: Message,
    array: np.ndarray | None = None,
    *,
    codec: str = "raw",
    compress: bool = False,
    level: int | None = None,
) -> bytes:
    """Encode one frame.

    Parameters
    ----------
    header
        A ``Forward``, ``Result`` or ``ErrorReply``; its payload fields (``width`` or
        ``rows``/``cols``, ``dtype``, ``codec``, ``compression``, ``payload_len``,
        ``checksum``) are filled from ``array``, whatever they held.
    array
        float32 ``[rows, width]``, C-contiguous (it is copied once, into the frame), or None.
    codec
        ``"raw"`` (bit-exact), ``"f16"``, ``"bf16"`` or ``"q8"`` (see docs/wire.md).
    compress, level
        zstd-compress the codec bytes at ``level`` (default 3). Ignored without an array.

    Returns
    -------
    bytes
        The frame; ``decode`` accepts it.

    Raises
    ------
    UnknownCodec
        ``codec`` is not one of ``CODECS``.
    InvalidBoundary
        The array's type, dtype, rank, layout or shape does not fit the header, or a lossy
        codec cannot represent its values.
    InvalidArgument
        The header is inconsistent (e.g. ``tokens`` length differs from ``n_tokens``).
    """
    header, payload = _prepare(header, array, codec, compress, level)
    prefix, hb = _head(header)
    return b"".join((prefix, hb, payload))


def encode_into(
    header: Message,
    array: np.ndarray | None,
    buf: bytearray,
    offset: int = 0,
    *,
    codec: str = "raw",
    compress: bool = False,
    level: int | None = None,
) -> int:
    """Encode one frame into ``buf`` at ``offset``, like ``msgspec`` ``encode_into``.

    ``buf`` is resized to exactly ``offset`` + the frame length (reuse it across calls to
    avoid allocations); the frame's payload alignment is relative to ``offset``.

    Returns
    -------
    int
        The frame length in bytes.

    Raises
    ------
    UnknownCodec, InvalidBoundary, InvalidArgument
        As ``encode``; also InvalidArgument when ``offset`` lies outside ``buf``.
    """
    if type(buf) is not bytearray:
        raise InvalidArgument(f"buf must be a bytearray, got {type(buf).__name__}")
    if not 0 <= offset <= len(buf):
        raise InvalidArgument(f"offset {offset} outside buf of {len(buf)} bytes")
    header, payload = _prepare(header, array, codec, compress, level)
    prefix, hb = _head(header)
    start = offset + PREFIX_SIZE + len(hb)
    end = start + (payload.nbytes if type(payload) is np.ndarray else len(payload))
    n = len(buf)
    if n < end:
        buf.extend(bytes(end - n))
    elif n > end:
        del buf[end:]
    with memoryview(buf) as out:  # memoryview slices copy straight in (bytearray's do not)
        out[offset : offset + PREFIX_SIZE] = prefix
        out[offset + PREFIX_SIZE : start] = hb
        out[start:end] = memoryview(payload).cast("B") if type(payload) is np.ndarray else payload
    return end - offset


# --- decode ---------------------------------------------------------------------


def decode(buf: Any, *, max_payload: int = MAX_PAYLOAD, max_header: int = MAX_HEADER) -> Frame:
    """Validate and decode one frame.

    Everything is checked (prefix, header checksum and schema, sizes against each other
    and against the limits, payload checksum, zstd declared size) before any allocation
    that depends on the frame's claims.

    Parameters
    ----------
    buf
        The whole frame: ``bytes``, ``bytearray``, ``memoryview`` or another C-contiguous
        buffer, exactly one frame long.
    max_payload
        Largest payload accepted, both as sent and once decompressed/decoded (bytes).
    max_header
        Largest msgpack header accepted (bytes).

    Returns
    -------
    Frame
        ``header`` and ``array`` (float32 ``[rows, cols]``, read-only; a view over
        ``buf`` for the raw codec without compression).

    Raises
    ------
    FrameTruncated
        ``buf`` is shorter than its prefix, header or payload claim.
    FrameTooLarge
        The header or payload exceeds ``max_header`` / ``max_payload``.
    FrameChecksumError
        The header or payload checksum does not match.
    FrameVersionError
        The format version is newer than ``FORMAT_VERSION`` or unknown flags are set.
    UnknownCodec
        The dtype, codec or compression is unknown.
    FrameError
        Anything else that is wrong with the frame. Nothing else escapes.
    """
    try:
        return _decode(buf, max_payload, max_header)
    except FrameError:
        raise
    except Exception as e:  # backstop: decode's contract is FrameError or a Frame
        raise FrameError(f"undecodable frame ({type(e).__name__}: {e})") from None


def _decode(buf: Any, max_payload: int, max_header: int) -> Frame:
    if type(buf) is not bytes:
        try:
            buf = memoryview(buf).cast("B").toreadonly()  # arrays over it are read-only
        except TypeError as e:
            raise FrameError(f"frame must be a C-contiguous bytes-like object: {e}") from None
    size = len(buf)
    if size < PREFIX_SIZE:
        raise FrameTruncated(f"frame truncated: {size} bytes, the prefix alone needs {PREFIX_SIZE}")
    magic, version, flags, reserved, hlen, hsum = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"not a dgr frame: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        if version > FORMAT_VERSION:
            raise FrameVersionError(
                f"frame format version {version} is newer than supported {FORMAT_VERSION}"
            )
        raise FrameError(f"frame format version {version} is invalid (first is 1)")
    if flags & ~_KNOWN_FLAGS:
        raise FrameVersionError(f"frame sets unknown flag bits 0x{flags & ~_KNOWN_FLAGS:02x}")
    if reserved:
        raise FrameError(f"reserved prefix field is 0x{reserved:04x}, must be 0")
    if hlen > max_header:
        raise FrameTooLarge(f"header length {hlen} exceeds max_header {max_header}")
    poff = (PREFIX_SIZE + hlen + PAYLOAD_ALIGN - 1) & -PAYLOAD_ALIGN
    if poff > size:
        raise FrameTruncated(
            f"frame truncated: header_len {hlen} puts the payload at byte {poff} "
            f"but the frame has {size} bytes"
        )
    mv = buf if type(buf) is memoryview else memoryview(buf)
    got = xxhash.xxh3_64_intdigest(mv[PREFIX_SIZE:poff]) & 0xFFFFFFFF
    if got != hsum:
        raise FrameChecksumError(
            f"header checksum mismatch: prefix says 0x{hsum:08x}, header bytes hash to 0x{got:08x}"
        )
    hbytes = mv[PREFIX_SIZE : PREFIX_SIZE + hlen]
    try:
        h = _DECODER.decode(hbytes)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise FrameError(f"invalid frame header: {_explain(str(e), hbytes)}") from None
    cls = type(h)
    if cls is ErrorReply or cls is Hello:
        if size != poff:
            raise FrameError(f"{cls.__name__} carries {size - poff} payload bytes, must carry none")
        return Frame(h, None)

    err = _check_forward(h) if cls is Forward else _check_result(h)
    if err:
        raise FrameError(err)
    codec = h.codec
    comp = h.compression
    if h.dtype != "f32":
        raise UnknownCodec(f"unknown dtype {h.dtype!r} (known: {', '.join(_DTYPES)})")
    if comp != "none" and comp != "zstd":
        raise UnknownCodec(f"unknown compression {comp!r} (known: {', '.join(COMPRESSIONS)})")
    if codec not in CODECS:
        raise UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    if cls is Forward:
        rows, cols = h.n_tokens, h.width
    else:
        rows, cols = h.rows, h.cols
    plen = h.payload_len
    if cols == 0:  # no array
        if codec != "raw" or comp != "none" or plen:
            raise FrameError(
                f"{cls.__name__} without an array must have codec 'raw', compression 'none' "
                f"and payload_len 0, got {codec!r}, {comp!r}, {plen}"
            )
    expect = 4 * rows * cols if codec == "raw" else payload_size(codec, rows, cols)
    if expect > max_payload or 4 * rows * cols > max_payload:
        raise FrameTooLarge(
            f"{rows} x {cols} {codec} payload is {expect} bytes ({4 * rows * cols} as f32), "
            f"above max_payload {max_payload}"
        )
    if plen > max_payload:
        raise FrameTooLarge(f"payload_len {plen} exceeds max_payload {max_payload}")
    if comp == "none":
        if plen != expect:
            raise FrameError(
                f"payload_len {plen} disagrees with the {rows} x {cols} {codec} payload size {expect}"
            )
    elif plen == 0:
        raise FrameError("zstd payload is empty")
    end = poff + plen
    if size != end:
        if size < end:
            raise FrameTruncated(
                f"frame truncated: payload_len {plen} at byte {poff} ends at {end} "
                f"but the frame has {size} bytes"
            )
        raise FrameError(f"{size - end} trailing bytes after the payload")
    got = xxhash.xxh3_64_intdigest(mv[poff:])
    if got != h.checksum:
        raise FrameChecksumError(
            f"payload checksum mismatch: header says 0x{h.checksum:016x}, "
            f"payload hashes to 0x{got:016x}"
        )
    if cols == 0:
        return Frame(h, None)
    if comp == "none":
        return Frame(h, decode_payload(buf, poff, codec, rows, cols))
    data = mv[poff:]
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise FrameError(f"zstd payload has no valid frame header: {e}") from None
    if declared != -1 and declared != expect:
        raise FrameError(f"zstd payload declares {declared} decoded bytes, expected {expect}")
    try:
        out = dctx().decompress(data, max_output_size=expect, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(f"zstd payload is corrupt: {e}") from None
    if len(out) != expect:
        raise FrameError(f"zstd payload decoded to {len(out)} bytes, expected {expect}")
    return Frame(h, decode_payload(out, 0, codec, rows, cols))
