"""dgr.protocol.wire: round trips per codec, bit-exact raw, lossy error bounds, every validation rule."""

from __future__ import annotations

import struct
import threading

import msgspec
import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dgr import errors
from dgr.errors import (
    FrameChecksumError,
    FrameError,
    FrameTooLarge,
    FrameTruncated,
    FrameVersionError,
    InvalidArgument,
    InvalidBoundary,
    UnknownCodec,
)
from dgr.protocol import wire

SETTINGS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# The documented field order (docs/wire.md): append-only, so these tuples may only grow.
FORWARD_FIELDS = (
    "schema", "model", "session", "epoch", "first_pos", "n_tokens", "layer", "width",
    "_reserved", "dtype", "codec", "compression", "payload_len", "checksum", "positions",
    "tokens", "want", "rows", "sampling", "relay", "reply_to", "loop", "steps", "stop_tokens",
    "solo", "rollback", "drafts", "speculate", "max_draft", "media", "sections", "causal",
)
RESULT_FIELDS = (
    "schema", "session", "epoch", "first_pos", "n_tokens", "kind", "layer", "rows", "cols",
    "_reserved", "dtype", "codec", "compression", "payload_len", "checksum", "tokens",
    "drafted",
)
ERROR_FIELDS = ("schema", "code", "message", "session", "epoch", "retry_after")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "greedy", "min_p", "bias_ids", "bias",
                   "penalty_last_n", "repeat_penalty", "frequency_penalty", "presence_penalty",
                   "grammar", "grammar_id", "grammar_from")
HOP_FIELDS = ("endpoint", "tokens")
HELLO_FIELDS = ("schema", "route")


# --- an independent encoder written from docs/wire.md -----------------------------


def build(
    header: object,
    payload: bytes = b"",
    *,
    magic: bytes = b"DGRF",
    version: int = 1,
    flags: int = 0,
    reserved: int = 0,
    hlen: int | None = None,
    hsum: int | None = None,
    pad_byte: int = 0,
) -> bytes:
    """A frame from a header (msgpack-encodable object or raw bytes) and a payload."""
    hb = header if isinstance(header, bytes) else msgspec.msgpack.encode(header)
    poff = (16 + len(hb) + 63) // 64 * 64
    body = hb + bytes([pad_byte]) * (poff - 16 - len(hb))
    s = xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
    prefix = struct.pack(
        "<4sBBHII", magic, version, flags, reserved,
        len(hb) if hlen is None else hlen, s if hsum is None else hsum,
    )
    return prefix + body + payload


def fwd_list(payload: bytes = b"", **kw: object) -> list:
    """A Forward header as the msgpack array [tag, fields...]; checksum/len follow payload."""
    f = dict(
        schema=wire.SCHEMA_VERSION, model="m", session="s", epoch=1, first_pos=0, n_tokens=2,
        layer=3, width=4,
        _reserved=1, dtype="f32", codec="raw", compression="none", payload_len=len(payload),
        checksum=xxhash.xxh3_64_intdigest(payload), positions=None, tokens=None,
        want="boundary", rows=None, sampling=None, relay=None, reply_to="", loop=None,
        steps=0, stop_tokens=None, solo=False, rollback=0, drafts=0, speculate="",
        max_draft=0, media="", sections=None, causal=True,
    )
    for k, v in kw.items():
        assert k in f, k
        f[k] = v
    return [1] + [f[k] for k in FORWARD_FIELDS]


def res_list(payload: bytes = b"", **kw: object) -> list:
    f = dict(
        schema=1, session="s", epoch=1, first_pos=0, n_tokens=2, kind="logits", layer=0,
        rows=1, cols=4, _reserved=1, dtype="f32", codec="raw", compression="none",
        payload_len=len(payload), checksum=xxhash.xxh3_64_intdigest(payload), tokens=None,
        drafted=0,
    )
    for k, v in kw.items():
        assert k in f, k
        f[k] = v
    return [2] + [f[k] for k in RESULT_FIELDS]


P8 = np.arange(8, dtype="<f4").tobytes()  # 2 x 4 raw payload
P4 = np.arange(4, dtype="<f4").tobytes()  # 1 x 4 raw payload


def fwd(**kw: object) -> wire.Forward:
    base = dict(model="m", session="s", epoch=1, first_pos=0, n_tokens=2, layer=3)
    base.update(kw)
    return wire.Forward(**base)


def rand(rows: int, cols: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    return a * np.float32(scale)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# --- layout -------------------------------------------------------------------------


def test_field_order_is_the_documented_one() -> None:
    assert wire.Forward.__struct_fields__ == FORWARD_FIELDS
    assert wire.Result.__struct_fields__ == RESULT_FIELDS
    assert wire.ErrorReply.__struct_fields__ == ERROR_FIELDS
    assert wire.Sampling.__struct_fields__ == SAMPLING_FIELDS
    assert wire.Hop.__struct_fields__ == HOP_FIELDS
    assert wire.Hello.__struct_fields__ == HELLO_FIELDS


def test_speculative_fields_match_the_document() -> None:
    # independent spelling of docs/wire.md: Forward fields 26-29, Result field 17 (schema 4)
    raw = fwd_list(P8, tokens=[4, 5], want="token", rollback=3, drafts=1, speculate="mtp",
                   max_draft=6)
    assert raw[26:30] == [3, 1, "mtp", 6] and len(raw) == 33
    h = wire.decode(build(raw, P8)).header
    assert (h.rollback, h.drafts, h.speculate, h.max_draft) == (3, 1, "mtp", 6)
    assert wire.encode(h, wire.decode(build(raw, P8)).array) == build(raw, P8)
    r = res_list(P4, tokens=[4, 9], drafted=1)
    assert len(r) == 18 and wire.decode(build(r, P4)).header.drafted == 1
    # a schema-3 sender (no items 26-29 / 17): the defaults
    h = wire.decode(build(fwd_list(P8, schema=3)[:26], P8)).header
    assert (h.rollback, h.drafts, h.speculate, h.max_draft) == (0, 0, "", 0)
    assert wire.decode(build(res_list(P4, schema=3)[:17], P4)).header.drafted == 0
    for kw, msg in (({"drafts": 2}, "a draft follows a token"),
                    ({"drafts": 1, "want": "logits"}, "want a token, rows None"),
                    ({"drafts": 1, "want": "token", "rows": [1]}, "want a token, rows None"),
                    ({"speculate": "eagle"}, "unknown Forward.speculate 'eagle'"),
                    ({"max_draft": wire.MAX_DRAFT + 1}, "at most 32")):
        with pytest.raises(FrameError, match=msg):
            wire.decode(build(fwd_list(P8, tokens=[4, 5], **kw), P8))
    with pytest.raises(FrameError, match=r"\(Forward.rollback\)"):
        wire.decode(build(fwd_list(P8, rollback=-1), P8))


def test_media_fields_match_the_document() -> None:
    # independent spelling of docs/wire.md: Forward fields 30-32 (schema 6)
    sections = [5, 5, 6, 6, 5, 6, 0, 0]  # 2 rows' t, then y, x, z (section-major)
    raw = fwd_list(P8, first_pos=5, media="image", sections=sections, causal=False)
    assert raw[30:33] == ["image", sections, False] and len(raw) == 33
    h = wire.decode(build(raw, P8)).header
    assert (h.media, h.sections, h.causal) == ("image", sections, False)
    assert wire.span(h) == 2 and wire.encode(h, wire.decode(build(raw, P8)).array) == build(raw, P8)
    # a schema-5 sender (no items 30-32): a step of token ids or a boundary, causal
    h = wire.decode(build(fwd_list(P8, schema=5)[:30], P8)).header
    assert (h.media, h.sections, h.causal) == ("", None, True) and wire.span(h) == 2
    for kw, msg in (({"media": "video"}, "unknown Forward.media 'video'"),
                    ({"media": "image", "tokens": [1, 2]}, "no token ids"),
                    ({"sections": [0] * 8}, "a media step's"),
                    ({"causal": False}, "a media step's"),
                    ({"media": "image", "sections": [0] * 10}, "10 entries but n_tokens is 2"),
                    ({"media": "image", "sections": [1] + [0] * 7},
                     r"sections\[0\] is 1 but first_pos is 0"),
                    ({"media": "image", "sections": [0] * 8, "positions": [0, 1]},
                     "one of them")):
        with pytest.raises(FrameError, match=msg):
            wire.decode(build(fwd_list(P8, **kw), P8))


def test_relay_fields_and_hello_match_the_document() -> None:
    # independent spelling of docs/wire.md: Forward fields 20-21, Hello = [4, schema, route]
    hops = [["10.0.0.2:7001", False], ["10.0.0.3:7001", True]]
    raw = fwd_list(P8, relay=hops, reply_to="r1")
    f = wire.decode(build(raw, P8))
    assert f.header.relay == [wire.Hop(endpoint="10.0.0.2:7001"),
                              wire.Hop(endpoint="10.0.0.3:7001", tokens=True)]
    assert f.header.reply_to == "r1"
    h = wire.decode(build([4, 2, "route-a"]))
    assert type(h.header) is wire.Hello and h.header.route == "route-a" and h.array is None
    assert wire.decode(wire.encode(wire.Hello(route="x"))).header == wire.Hello(route="x")
    with pytest.raises(FrameError, match="Hello carries 64 payload bytes"):
        wire.decode(build([4, 2, "r"], b"x" * 64))
    with pytest.raises(FrameError, match="reply_to is empty"):
        wire.decode(build(fwd_list(P8, relay=hops), P8))
    with pytest.raises(InvalidArgument, match="carries no array"):
        wire.encode(wire.Hello(route="r"), rand(1, 1))
    # the decode loop: fields 22-24
    loop = [["10.0.0.1:7001", True], *hops]
    f = wire.decode(build(fwd_list(P8, relay=hops, reply_to="r1", loop=loop, steps=5,
                                   want="token", stop_tokens=[2, 7]), P8))
    assert f.header.steps == 5 and f.header.stop_tokens == [2, 7]
    assert [h.endpoint for h in f.header.loop] == ["10.0.0.1:7001", "10.0.0.2:7001",
                                                   "10.0.0.3:7001"]
    for kw, msg in ((dict(loop=None), "loop or reply_to is empty"),
                    (dict(want="logits"), "a loop feeds tokens"),
                    (dict(rows=[1]), "rows must be None")):
        raw = {**dict(relay=hops, reply_to="r1", loop=loop, steps=2, want="token"), **kw}
        with pytest.raises(FrameError, match=msg):
            wire.decode(build(fwd_list(P8, **raw), P8))


def test_prefix_layout_and_alignment() -> None:
    for model in ("", "m" * 5, "m" * 40, "m" * 200):
        a = rand(2, 4)
        b = wire.encode(fwd(model=model), a)
        magic, version, flags, reserved, hlen, hsum = struct.unpack_from("<4sBBHII", b)
        assert (magic, version, flags, reserved) == (b"DGRF", 1, 0, 0)
        poff = (16 + hlen + 63) // 64 * 64
        assert poff % 64 == 0 and len(b) == poff + a.nbytes
        assert b[16 + hlen : poff] == bytes(poff - 16 - hlen)
        assert hsum == xxhash.xxh3_64_intdigest(b[16:poff]) & 0xFFFFFFFF
        assert b[poff:] == a.tobytes()
        header = msgspec.msgpack.decode(b[16 : 16 + hlen])
        assert header[0] == 1 and header[1:] == fwd_list(a.tobytes(), model=model)[1:]
        assert build(fwd_list(a.tobytes(), model=model), a.tobytes()) == b


def test_independent_builder_frames_decode() -> None:
    f = wire.decode(build(fwd_list(P8), P8))
    assert f.header == fwd(width=4, payload_len=32, checksum=xxhash.xxh3_64_intdigest(P8))
    assert f.array.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# --- round trips --------------------------------------------------------------------

BF16_SAFE = float(np.float32(3.38e38))  # below the largest bf16, so nothing rounds to inf
shapes = st.tuples(st.integers(1, 6), st.integers(1, 300))


@SETTINGS
@given(
    shape=shapes,
    seed=st.integers(0, 2**32 - 1),
    codec=st.sampled_from(wire.CODECS),
    compress=st.booleans(),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 300.0]),
)
def test_round_trip_every_codec(shape, seed, codec, compress, scale) -> None:
    a = rand(*shape, seed=seed, scale=scale)
    h = fwd(n_tokens=shape[0], tokens=list(range(shape[0])))
    f = wire.decode(wire.encode(h, a, codec=codec, compress=compress, level=1))
    assert f.array.shape == a.shape and f.array.dtype == np.float32
    assert not f.array.flags.writeable
    hdr = f.header
    assert (hdr.codec, hdr.compression, hdr.width) == (codec, "zstd" if compress else "none", shape[1])
    assert msgspec.structs.replace(
        hdr, width=0, codec="raw", compression="none", payload_len=0, checksum=0
    ) == h
    err = np.abs(f.array.astype(np.float64) - a)
    if codec == "raw":
        assert np.array_equal(bits(f.array), bits(a))
    elif codec == "f16":
        assert np.all(err <= np.maximum(np.abs(a) * 2.0**-11, 2.0**-25))
    elif codec == "bf16":
        assert np.all(err <= np.maximum(np.abs(a) * 2.0**-8, 2.0**-134))
    else:
        amax = np.abs(a).max(axis=1, keepdims=True).astype(np.float64)
        assert np.all(err <= amax / 254 * (1 + 2.0**-20) + 2.0**-140)


@SETTINGS
@given(
    a=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.integers(1, 40)),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    ),
    compress=st.booleans(),
)
def test_raw_is_bit_exact_for_every_value(a, compress) -> None:
    a = np.ascontiguousarray(a)
    f = wire.decode(wire.encode(fwd(n_tokens=a.shape[0]), a, compress=compress))
    assert np.array_equal(bits(f.array), bits(a))


def test_raw_is_bit_exact_for_every_bit_pattern() -> None:
    a = np.random.default_rng(7).integers(0, 2**32, (64, 1024), dtype=np.uint32).view(np.float32)
    for compress in (False, True):
        f = wire.decode(wire.encode(fwd(n_tokens=64), a, compress=compress))
        assert np.array_equal(bits(f.array), bits(a))


@SETTINGS
@given(
    a=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.integers(1, 40)),
        elements=st.floats(width=32, min_value=-BF16_SAFE, max_value=BF16_SAFE, allow_subnormal=True),
    ),
    codec=st.sampled_from(["f16", "bf16", "q8"]),
)
def test_lossy_bounds_hold_at_extremes(a, codec) -> None:
    a = np.ascontiguousarray(a)
    if codec == "f16":
        a = np.clip(a, -65504, 65504)
    f = wire.decode(wire.encode(fwd(n_tokens=a.shape[0]), a, codec=codec))
    err = np.abs(f.array.astype(np.float64) - a)
    if codec == "f16":
        assert np.all(err <= np.maximum(np.abs(a) * 2.0**-11, 2.0**-25))
    elif codec == "bf16":
        assert np.all(err <= np.maximum(np.abs(a).astype(np.float64) * 2.0**-8, 2.0**-134))
    else:
        amax = np.abs(a).max(axis=1, keepdims=True).astype(np.float64)
        assert np.all(err <= amax / 254 * (1 + 2.0**-20) + 2.0**-140)


def test_measured_error_on_gaussian_rows() -> None:
    """The numbers docs/wire.md quotes (N(0, 1) rows, width 4096)."""
    a = rand(64, 4096, seed=3)
    rel = {}
    for codec in ("f16", "bf16", "q8"):
        d = wire.decode(wire.encode(fwd(n_tokens=64), a, codec=codec)).array
        rel[codec] = float(np.max(np.abs(d - a) / np.abs(a).max(axis=1, keepdims=True)))
    assert rel["f16"] < 2.0**-11 and rel["bf16"] < 2.0**-8
    assert 0.9 / 254 < rel["q8"] <= 1 / 254 * (1 + 2.0**-20)


def test_special_values_in_lossy_codecs() -> None:
    a = np.array([[np.nan, -np.nan, np.inf, -np.inf, -0.0, 1.0, 3e38, 1e-45]], np.float32)
    nan_payload = np.array([0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)[None, :]
    d = wire.decode(wire.encode(fwd(n_tokens=1), a, codec="bf16")).array
    assert np.isnan(d[0, :2]).all() and d[0, 2] == np.inf and d[0, 3] == -np.inf
    assert bits(d)[0, 4] == 0x80000000 and d[0, 5] == 1.0
    d = wire.decode(wire.encode(fwd(n_tokens=1), nan_payload, codec="bf16")).array
    assert np.isnan(d).all() and list(np.signbit(d[0])) == [False, True]
    d = wire.decode(wire.encode(fwd(n_tokens=1), a[:, :6], codec="f16")).array
    assert np.isnan(d[0, :2]).all() and list(d[0, 2:6]) == [np.inf, -np.inf, 0.0, 1.0]
    zero = np.zeros((2, 5), np.float32)
    assert not wire.decode(wire.encode(fwd(), zero, codec="q8")).array.any()


def test_raw_decode_is_a_view_over_the_buffer() -> None:
    a = rand(2, 16)
    b = wire.encode(fwd(), a)
    f = wire.decode(b)
    assert f.array.base is b
    ba = bytearray(b)
    f = wire.decode(ba)
    assert not f.array.flags.writeable
    ba[-4:] = np.float32(42.0).tobytes()
    assert f.array[1, 15] == 42.0  # the same memory: no copy was made
    f = wire.decode(memoryview(b))
    assert np.array_equal(f.array, a)


def test_payload_alignment_gives_aligned_views() -> None:
    buf = np.zeros(1 << 16, np.uint8)  # any receive buffer: the payload keeps its alignment
    frame = wire.encode(fwd(), rand(2, 16))
    buf[: len(frame)] = np.frombuffer(frame, np.uint8)
    view = memoryview(buf)[: len(frame)]
    arr = wire.decode(view).array
    assert arr.flags.aligned and arr.ctypes.data % 64 == buf.ctypes.data % 64


def test_frames_without_an_array() -> None:
    f = wire.decode(wire.encode(fwd(tokens=[5, 6], positions=[0, 1])))
    assert f.array is None and f.header.tokens == [5, 6] and f.header.width == 0
    assert f.header.checksum == xxhash.xxh3_64_intdigest(b"")
    f = wire.decode(wire.encode(fwd(tokens=[5, 6]), compress=True))
    assert f.header.compression == "none" and f.array is None
    r = wire.Result(session="s", epoch=2, first_pos=7, n_tokens=1, tokens=[42])
    f = wire.decode(wire.encode(r))
    assert f.array is None and f.header.tokens == [42] and f.header.kind == "none"


def test_result_with_logits_and_token() -> None:
    logits = rand(3, 49152, seed=1)
    r = wire.Result(session="s", epoch=2, first_pos=7, n_tokens=3, kind="logits", tokens=[1, 2, 3])
    for codec in wire.CODECS:
        f = wire.decode(wire.encode(r, logits, codec=codec, compress=True))
        assert (f.header.rows, f.header.cols) == (3, 49152) and f.header.tokens == [1, 2, 3]
        assert f.array.shape == (3, 49152)


def test_result_boundary() -> None:
    a = rand(2, 4 * 32)
    r = wire.Result(session="s", epoch=1, first_pos=0, n_tokens=2, kind="boundary", layer=7)
    f = wire.decode(wire.encode(r, a))
    assert f.header.layer == 7 and f.header.cols == 128 and np.array_equal(f.array, a)


def test_the_retired_streams_slots_keep_every_other_field_in_place() -> None:
    """Schema 3 retired ``streams`` (Forward field 9, Result field 10; always 1) but keeps
    the slots: a schema-2 receiver reads the 1 it always read there, and a schema-2 sender's
    frame decodes with every field where it was, its slot's value ignored (the width is the
    boundary's, whatever divides it)."""
    # what this build sends: 1 in the slot, exactly as a schema-2 sender did
    sent = wire.encode(fwd(tokens=[1, 2]), rand(2, 6))
    hlen = struct.unpack_from("<I", sent, 8)[0]
    items = msgspec.msgpack.decode(sent[16:16 + hlen])
    assert items[:10] == [1, wire.SCHEMA_VERSION, "m", "s", 1, 0, 2, 3, 6, 1]
    assert items[10] == "f32" and items[16] == [1, 2]
    # a schema-2 sender's Forward and Result with streams 3, which does not divide 4 (a
    # schema-2 receiver refused that; nothing but tests ever sent it)
    f = wire.decode(build(fwd_list(P8, schema=2, _reserved=3, tokens=[7, 8]), P8))
    assert (f.header.width, f.header.dtype, f.header.tokens) == (4, "f32", [7, 8])
    assert np.array_equal(f.array, np.arange(8, dtype=np.float32).reshape(2, 4))
    r = wire.decode(build(res_list(P4, schema=2, kind="boundary", layer=2, _reserved=3), P4))
    assert (r.header.kind, r.header.cols, r.header.dtype) == ("boundary", 4, "f32")


def test_forward_with_everything() -> None:
    s = wire.Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1, greedy=False)
    h = fwd(
        n_tokens=3, first_pos=10, positions=[10, 11, 12], tokens=[1, 2, 3],
        want="token+logits", rows=[0, 2], sampling=s, epoch=2**63 - 1,
    )
    a = rand(3, 4 * 64)
    f = wire.decode(wire.encode(h, a, codec="bf16", compress=True, level=19))
    assert f.header.sampling == s and f.header.rows == [0, 2] and f.header.epoch == 2**63 - 1
    assert f.header.width == 256


def test_error_reply_round_trip() -> None:
    exc = errors.ResourceExhausted("no free slot", retry_after=0.25)
    rep = wire.ErrorReply.from_exception(exc, session="s", epoch=3)
    f = wire.decode(wire.encode(rep))
    assert f.array is None and f.header == rep and f.header.code == 34
    back = f.header.to_exception()
    assert type(back) is errors.ResourceExhausted and back.retry_after == 0.25
    assert str(back) == "no free slot"
    other = wire.ErrorReply.from_exception(KeyError("/home/op/model.gguf"))
    assert other.code == 100 and type(other.to_exception()) is errors.DgrError
    assert other.message.startswith("internal error") and "model.gguf" not in other.message
    assert type(wire.ErrorReply(code=999, message="?").to_exception()) is errors.DgrError


def test_encode_into_matches_encode_and_reuses_the_buffer() -> None:
    buf = bytearray(b"head")
    a = rand(2, 64)
    n = wire.encode_into(fwd(), a, buf, 4, codec="f16")
    assert buf[:4] == b"head" and bytes(buf[4:]) == wire.encode(fwd(), a, codec="f16")
    assert n == len(buf) - 4
    for shape in [(2, 8), (2, 512), (2, 8)]:  # shrink, grow, shrink
        a = rand(*shape)
        n = wire.encode_into(fwd(), a, buf)
        assert n == len(buf) and bytes(buf) == wire.encode(fwd(), a)
        assert np.array_equal(wire.decode(buf).array, a)
    with pytest.raises(InvalidArgument, match="bytearray"):
        wire.encode_into(fwd(), a, b"")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="offset 99 outside"):
        wire.encode_into(fwd(), a, bytearray(), 99)


def test_newer_schema_with_appended_fields_is_accepted() -> None:
    """Append-only evolution: an old receiver ignores fields it does not know."""
    h = fwd_list(P8, schema=7) + ["a field from the future", [1, 2]]
    f = wire.decode(build(h, P8))
    assert f.header.schema == 7 and f.array.shape == (2, 4)
    # and a sender of schema 1 can be read by a receiver whose struct grew
    class Future(msgspec.Struct, tag=1, array_like=True, frozen=True, kw_only=True):
        __annotations__ = {k: object for k in FORWARD_FIELDS} | {"extra": int}
        extra = 5
    later = msgspec.msgpack.Decoder(Future).decode(msgspec.msgpack.encode(fwd_list(P8)))
    assert later.extra == 5 and later.model == "m"


def test_zstd_contexts_are_per_thread() -> None:
    a = rand(8, 512, seed=5)
    frames = [wire.encode(fwd(n_tokens=8), a, compress=True) for _ in range(2)]
    assert frames[0] == frames[1]
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                b = wire.encode(fwd(n_tokens=8), a, compress=True)
                assert b == frames[0]
                assert np.array_equal(wire.decode(b).array, a)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


# --- encode-side errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: wire.encode(fwd(), rand(2, 4), codec="q4"), UnknownCodec, "unknown codec 'q4'"),
        (lambda: wire.encode(fwd(), rand(2, 4).astype(np.float64)), InvalidBoundary, "float32, got float64"),
        (lambda: wire.encode(fwd(), [[1.0]]), InvalidBoundary, "numpy.ndarray, got list"),
        (lambda: wire.encode(fwd(), rand(2, 8)[:, ::2]), InvalidBoundary, "C-contiguous"),
        (lambda: wire.encode(fwd(), rand(2, 8)[:, ::2], compress=True), InvalidBoundary, "C-contiguous"),
        (lambda: wire.encode(fwd(), rand(1, 8)[0]), InvalidBoundary, "2-D"),
        (lambda: wire.encode(fwd(), rand(3, 4)), InvalidBoundary, "3 rows but Forward.n_tokens is 2"),
        (lambda: wire.encode(fwd(width=8), rand(2, 4)), InvalidBoundary, "width 4 but Forward.width is 8"),
        (lambda: wire.encode(fwd(), rand(2, 0)), InvalidBoundary, "width 0"),
        (lambda: wire.encode(fwd(width=8)), InvalidBoundary, "no array was given"),
        (lambda: wire.encode(fwd(n_tokens=0), rand(0, 4)), InvalidArgument, "zero-token steps"),
        (lambda: wire.encode(fwd(tokens=[1]), rand(2, 4)), InvalidArgument, "tokens has 1 ids but n_tokens is 2"),
        (lambda: wire.encode(fwd()), InvalidArgument, "neither a boundary"),
        (lambda: wire.encode(fwd(epoch=2**64, tokens=[1, 2])), InvalidArgument, "cannot encode Forward"),
        (lambda: wire.encode(fwd(), rand(2, 4) * 1e5, codec="f16"), InvalidBoundary, "f16 range"),
        (lambda: wire.encode(fwd(), rand(2, 4) / 0, codec="q8"), InvalidBoundary, "q8 needs finite"),
        (lambda: wire.encode(fwd(), rand(2, 4), compress=True, level=10**9), InvalidArgument, "zstd"),
        (lambda: wire.encode(wire.ErrorReply(code=1, message="x"), rand(1, 1)), InvalidArgument, "carries no array"),
        (lambda: wire.encode(wire.Result(session="s", epoch=0, first_pos=0, n_tokens=1), rand(1, 4)),
         InvalidArgument, "Result.kind must be"),
        (lambda: wire.encode(wire.Sampling()), InvalidArgument, "not a dgr wire message"),
    ],
)
def test_encode_rejects(call, exc, match) -> None:
    with np.errstate(divide="ignore", invalid="ignore"):
        with pytest.raises(exc, match=match) as info:
            call()
    assert type(info.value) is exc


def test_big_endian_float32_is_converted() -> None:
    a = rand(2, 4)
    f = wire.decode(wire.encode(fwd(), a.astype(">f4")))
    assert np.array_equal(f.array, a)


# --- decode: one precise error per rule ---------------------------------------------

GOOD = build(fwd_list(P8), P8)


def _set_prefix(frame: bytes, fmt: str, offset: int, value: int) -> bytes:
    b = bytearray(frame)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _zstd(data: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(data)


Z8 = _zstd(P8)
ZBAD = Z8[:6] + b"\xff" * (len(Z8) - 6)  # the block header is broken, not just the data

DECODE_CASES = [
    ("not bytes-like", "a string", FrameError, "bytes-like"),
    ("empty", b"", FrameTruncated, r"0 bytes, the prefix alone needs 16"),
    ("short prefix", GOOD[:15], FrameTruncated, r"15 bytes, the prefix alone needs 16"),
    ("bad magic", b"XGRF" + GOOD[4:], FrameError, r"magic b'XGRF', expected b'DGRF'"),
    ("newer format", build(fwd_list(P8), P8, version=2), FrameVersionError, "version 2 is newer than supported 1"),
    ("format 0", build(fwd_list(P8), P8, version=0), FrameError, "version 0 is invalid"),
    ("unknown flags", build(fwd_list(P8), P8, flags=0x81), FrameVersionError, "unknown flag bits 0x81"),
    ("reserved", build(fwd_list(P8), P8, reserved=3), FrameError, "reserved prefix field is 0x0003"),
    ("huge header", build(fwd_list(P8), P8, hlen=2**32 - 1), FrameTooLarge, "header length 4294967295 exceeds max_header"),
    ("header past end", build(fwd_list(P8), P8, hlen=200), FrameTruncated, "header_len 200 puts the payload at byte 256"),
    ("header checksum", _set_prefix(GOOD, "<I", 12, 1), FrameChecksumError, "header checksum mismatch: prefix says 0x00000001"),
    ("padding changed", build(fwd_list(P8), P8, pad_byte=1)[:16] + GOOD[16:], FrameChecksumError, "header checksum"),
    ("not msgpack", build(b"\xc1\xc1", b""), FrameError, "invalid frame header: .*"),
    ("not an array", build({"a": 1}), FrameError, "invalid frame header"),
    ("unknown tag", build([9, 1, "m"]), FrameError, "invalid frame header: Invalid value 9"),
    ("missing fields", build([1, 1, "m", "s"]), FrameError, r"invalid frame header: Expected `array` of at least length"),
    ("wrong type", build(fwd_list(P8, model=5), P8), FrameError, r"Expected `str`, got `int` - at `\$\[2\]` \(Forward.model\)"),
    ("negative epoch", build(fwd_list(P8, epoch=-1), P8), FrameError, r"Expected `int` >= 0 - at `\$\[4\]` \(Forward.epoch\)"),
    ("schema 0", build(fwd_list(P8, schema=0), P8), FrameError, r"\(Forward.schema\)"),
    ("zero tokens", build(fwd_list(b"", n_tokens=0, width=0, tokens=[]), b""), FrameError, r">= 1 - at `\$\[6\]` \(Forward.n_tokens\)"),
    ("bad token id", build(fwd_list(P8, tokens=[1, -2]), P8), FrameError, r"at `\$\[16\]\[1\]` \(Forward.tokens\)"),
    ("bad top_p", build(fwd_list(P8, sampling=[1.0, 0, 0.0, 0, False]), P8), FrameError, r"\(Forward.sampling.top_p\)"),
    ("nan temperature", build(fwd_list(P8, sampling=[float("nan"), 0, 1.0, 0, False]), P8), FrameError, r"\(Forward.sampling.temperature\)"),
    ("token count", build(fwd_list(P8, tokens=[1, 2, 3]), P8), FrameError, "Forward.tokens has 3 ids but n_tokens is 2"),
    ("position count", build(fwd_list(P8, positions=[0]), P8), FrameError, "Forward.positions has 1 entries but n_tokens is 2"),
    ("first position", build(fwd_list(P8, positions=[1, 2]), P8), FrameError, r"positions\[0\] is 1 but first_pos is 0"),
    ("position overflow", build(fwd_list(P8, first_pos=2**31 - 1), P8), FrameError, "overflows int32 positions"),
    ("reserved slot", build(fwd_list(P8, _reserved=0), P8), FrameError, r">= 1 - at `\$\[9\]` \(Forward._reserved\)"),
    ("nothing to run", build(fwd_list(b"", width=0)), FrameError, "neither a boundary"),
    ("want", build(fwd_list(P8, want="everything"), P8), FrameError, "unknown Forward.want 'everything'"),
    ("rows range", build(fwd_list(P8, rows=[0, 2]), P8), FrameError, "Forward.rows names row 2 but n_tokens is 2"),
    ("rows empty", build(fwd_list(P8, rows=[]), P8), FrameError, "Forward.rows is empty"),
    ("result kind", build(res_list(P4, kind="probs"), P4), FrameError, "unknown Result.kind 'probs'"),
    ("result none+rows", build(res_list(P4, kind="none"), P4), FrameError, "Result.kind is 'none' but rows x cols is 1 x 4"),
    ("result empty", build(res_list(b"", rows=0, cols=0)), FrameError, "Result.kind is 'logits' but rows x cols is 0 x 0"),
    ("error payload", build([3, 1, 5, "boom"], b"x" * 64), FrameError, "ErrorReply carries 64 payload bytes"),
    ("unknown dtype", build(fwd_list(P8, dtype="f64"), P8), UnknownCodec, "unknown dtype 'f64'"),
    ("unknown codec", build(fwd_list(P8, codec="q4"), P8), UnknownCodec, "unknown codec 'q4'"),
    ("unknown compression", build(fwd_list(P8, compression="lz4"), P8), UnknownCodec, "unknown compression 'lz4'"),
    ("no-array codec", build(fwd_list(b"", width=0, tokens=[1, 2], codec="q8")), FrameError, "without an array must have codec 'raw'"),
    ("no-array payload", build(fwd_list(P8, width=0, tokens=[1, 2]), P8), FrameError, "without an array must have"),
    ("declared too large", build(fwd_list(P8, n_tokens=2**20, width=2**20), P8), FrameTooLarge,
     r"1048576 x 1048576 raw payload is 4398046511104 bytes .* above max_payload 268435456"),
    ("q8 decodes too large", build(fwd_list(P8, n_tokens=1, width=2**26 + 1, codec="q8"), P8), FrameTooLarge,
     r"as f32\), above max_payload"),
    ("payload_len too large", build(fwd_list(P8, compression="zstd", payload_len=2**40), P8), FrameTooLarge,
     "payload_len 1099511627776 exceeds max_payload"),
    ("sizes disagree", build(fwd_list(P8, payload_len=31), P8[:31]), FrameError,
     "payload_len 31 disagrees with the 2 x 4 raw payload size 32"),
    ("payload truncated", GOOD[:-1], FrameTruncated, "payload_len 32 at byte 128 ends at 160 but the frame has 159 bytes"),
    ("trailing bytes", GOOD + b"\0\0", FrameError, "2 trailing bytes after the payload"),
    ("payload checksum", GOOD[:-1] + b"\x01", FrameChecksumError, "payload checksum mismatch: header says 0x"),
    ("zstd empty", build(fwd_list(b"", compression="zstd")), FrameError, "zstd payload is empty"),
    ("zstd garbage", build(fwd_list(b"garbage!", compression="zstd"), b"garbage!"), FrameError, "zstd payload has no valid frame header"),
    ("zstd size lie", build(fwd_list(_zstd(P4), compression="zstd"), _zstd(P4)), FrameError, "declares 16 decoded bytes, expected 32"),
    ("zstd bomb", build(fwd_list(_zstd(bytes(1 << 20), content_size=False), compression="zstd"),
                        _zstd(bytes(1 << 20), content_size=False)), FrameError, "zstd payload is corrupt"),
    ("zstd short", build(fwd_list(_zstd(P4, content_size=False), compression="zstd"),
                         _zstd(P4, content_size=False)), FrameError, "decoded to 16 bytes, expected 32"),
    ("zstd trailing", build(fwd_list(Z8 + b"xx", compression="zstd"), Z8 + b"xx"), FrameError, "zstd payload is corrupt: .*unused data"),
    ("zstd corrupt", build(fwd_list(ZBAD, compression="zstd"), ZBAD), FrameError, "zstd payload is corrupt"),
]


@pytest.mark.parametrize(("frame", "exc", "match"), [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES])
def test_decode_rejects(frame, exc, match) -> None:
    with pytest.raises(exc, match=match) as info:
        wire.decode(frame)
    assert type(info.value) is exc, info.value


def test_limits_are_configurable() -> None:
    a = rand(4, 1024)
    b = wire.encode(fwd(n_tokens=4), a)
    with pytest.raises(FrameTooLarge, match="above max_payload 16383"):
        wire.decode(b, max_payload=16383)
    assert wire.decode(b, max_payload=16384).array.shape == (4, 1024)
    with pytest.raises(FrameTooLarge, match="exceeds max_header 10"):
        wire.decode(b, max_header=10)
    z = wire.encode(fwd(n_tokens=4), np.zeros((4, 1024), np.float32), compress=True)
    with pytest.raises(FrameTooLarge, match="above max_payload"):
        wire.decode(z, max_payload=4096)  # tiny on the wire, too large once decompressed


def test_every_decode_error_is_a_dgr_frame_error() -> None:
    for _name, frame, _exc, _ in DECODE_CASES:
        with pytest.raises(FrameError) as info:
            wire.decode(frame)
        assert isinstance(info.value, errors.DgrError) and isinstance(info.value, ValueError)
        assert 20 <= info.value.code <= 29
