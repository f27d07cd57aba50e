"""Fuzzing dgr.protocol.wire.decode: only FrameError escapes, and lies never buy an allocation."""

from __future__ import annotations

import random
import struct
import tracemalloc

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr.errors import FrameError, FrameTooLarge, FrameTruncated
from dgr.protocol import wire

SETTINGS = settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
PREFIX = struct.Struct("<4sBBHII")
SEED = 20240601
MUTATED_INPUTS = 100_000
MAX_PAYLOAD = 64 << 10  # small, so that "no allocation beyond the limit" is measurable


def corpus() -> list[bytes]:
    """Valid frames of every message kind, codec and compression (small, so decode is fast)."""
    rng = np.random.default_rng(SEED)
    out = []
    samp = wire.Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    for codec in wire.CODECS:
        for compress in (False, True):
            for rows, cols in ((1, 8), (3, 16)):
                a = rng.standard_normal((rows, cols), dtype=np.float32)
                h = wire.Forward(
                    model="smollm2-135m-q4_1", session="sess-1", epoch=3, first_pos=17,
                    n_tokens=rows, layer=12, tokens=list(range(100, 100 + rows)),
                    positions=list(range(17, 17 + rows)), want="token", rows=[rows - 1],
                    sampling=samp,
                )
                out.append(wire.encode(h, a, codec=codec, compress=compress))
                r = wire.Result(session="sess-1", epoch=3, first_pos=17, n_tokens=rows, kind="logits", tokens=[5])
                out.append(wire.encode(r, a, codec=codec, compress=compress))
    out.append(wire.encode(wire.Forward(model="m", session="s", epoch=0, first_pos=0, n_tokens=2, layer=0, tokens=[1, 2])))
    out.append(wire.encode(wire.Result(session="s", epoch=0, first_pos=0, n_tokens=1, tokens=[3])))
    out.append(wire.encode(wire.ErrorReply(code=34, message="busy", retry_after=0.5)))
    return out


CORPUS = corpus()

LIES: list[object] = [
    0, 1, -1, 2, 7, 63, 64, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1,
    2**63, 2**64 - 1, -(2**63), 0.5, -0.0, float("nan"), float("inf"), "", "raw", "f16", "bf16",
    "q8", "zstd", "none", "f32", "f64", "logits", "boundary", "token", "x" * 300, None, True,
    False, [], [0], [2**31], [-1], list(range(70)), [None], {}, {"a": 1}, b"\x00" * 8, [1.0, 0, 1.0, 0, False],
]


def resign(header: list, payload: bytes, fix_checksum: bool) -> bytes:
    """Re-encode a (mutated) header list with valid prefix and, optionally, payload checksum."""
    tag = header[0] if header else None
    at = 14 if tag == 1 else 15 if tag == 2 else None  # Forward's / Result's checksum
    if fix_checksum and at is not None and len(header) > at:
        header = list(header)
        header[at] = xxhash.xxh3_64_intdigest(payload)
    try:
        hb = msgspec.msgpack.encode(header)
    except (OverflowError, TypeError, msgspec.EncodeError):
        hb = b"\x90"
    poff = (16 + len(hb) + 63) // 64 * 64
    body = hb + bytes(poff - 16 - len(hb))
    return PREFIX.pack(b"DGRF", 1, 0, 0, len(hb), xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF) + body + payload


def split(frame: bytes) -> tuple[list, bytes]:
    _m, _v, _f, _r, hlen, _s = PREFIX.unpack_from(frame)
    poff = (16 + hlen + 63) // 64 * 64
    return msgspec.msgpack.decode(frame[16 : 16 + hlen]), frame[poff:]


SPLIT = [split(f) for f in CORPUS]


def mutate(rng: random.Random) -> bytes:
    """One mutated frame; each branch targets a different layer of the decoder."""
    i = rng.randrange(len(CORPUS))
    frame = CORPUS[i]
    kind = rng.randrange(12)
    if kind == 0:  # bit flips anywhere
        b = bytearray(frame)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 1:  # bit flips in the prefix
        b = bytearray(frame)
        b[rng.randrange(16)] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:  # truncation
        return frame[: rng.randrange(len(frame))]
    if kind == 3:  # extension
        return frame + rng.randbytes(rng.randint(1, 80))
    if kind == 4:  # overwrite a range with random bytes
        b = bytearray(frame)
        at = rng.randrange(len(b))
        n = rng.randint(1, 32)
        b[at : at + n] = rng.randbytes(n)
        return bytes(b)
    if kind == 5:  # lying header length (checksum kept, so it usually fails there)
        b = bytearray(frame)
        struct.pack_into("<I", b, 8, rng.choice([0, 1, 63, 64, 65, 2**31, 2**32 - 1, rng.randrange(2**32)]))
        return bytes(b)
    header, payload = SPLIT[i]
    if kind == 6:  # random bytes in the msgpack header, re-signed: the msgpack decoder sees them
        hb = bytearray(msgspec.msgpack.encode(header))
        for _ in range(rng.randint(1, 4)):
            hb[rng.randrange(len(hb))] = rng.randrange(256)
        poff = (16 + len(hb) + 63) // 64 * 64
        body = bytes(hb) + bytes(poff - 16 - len(hb))
        s = xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
        return PREFIX.pack(b"DGRF", 1, 0, 0, len(hb), s) + body + payload
    if kind in (7, 8):  # a field lies (sizes, codec, counts...), everything re-signed
        h = list(header)
        for _ in range(rng.randint(1, 3)):
            h[rng.randrange(len(h))] = rng.choice(LIES)
        return resign(h, payload, fix_checksum=kind == 8)
    if kind == 9:  # payload corrupted but its checksum fixed: zstd and codecs see garbage
        b = bytearray(payload)
        if b:
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        return resign(header, bytes(b), fix_checksum=True)
    if kind == 10:  # header array shortened or extended
        h = list(header)
        h = h[: rng.randrange(len(h))] if rng.random() < 0.5 else h + [rng.choice(LIES)]
        return resign(h, payload, fix_checksum=False)
    return rng.randbytes(rng.randint(0, 200))  # noise, sometimes behind a valid magic


def check(frame: bytes, **limits: int) -> bool:
    """Decode; True if it decoded. Anything but a Frame or a FrameError fails the test."""
    try:
        f = wire.decode(frame, **limits)
    except FrameError as e:
        # decode's catch-all backstop must never be what caught it: every failure the
        # decoder can meet has its own check and message
        assert not str(e).startswith("undecodable frame"), e
        return False
    assert isinstance(f, wire.Frame)
    if f.array is not None:
        assert f.array.dtype == np.float32 and f.array.shape == f.header.shape
        assert f.array.nbytes <= limits.get("max_payload", wire.MAX_PAYLOAD)
    return True


def test_seeded_mutation_fuzz() -> None:
    """The bulk: 100,000 mutated frames (seeded, reproducible): each decodes to a valid
    frame or is refused with its own ``FrameError``, never anything else."""
    rng = random.Random(SEED)
    decoded = 0
    for n in range(MUTATED_INPUTS):
        frame = mutate(rng)
        try:
            decoded += check(frame, max_payload=MAX_PAYLOAD)
        except BaseException as e:  # name the input that broke the contract
            raise AssertionError(f"input #{n} {frame!r} escaped with {type(e).__name__}: {e}") from e
    assert 0 < decoded < MUTATED_INPUTS  # some mutations are harmless, most are caught


def test_valid_corpus_decodes() -> None:
    assert all(check(f) for f in CORPUS)


def test_mutations_allocate_nothing_beyond_the_limit() -> None:
    """tracemalloc sees numpy, zstd and msgspec allocations: none exceeds the payload limit."""
    rng = random.Random(SEED + 1)
    frames = [mutate(rng) for _ in range(3000)]
    tracemalloc.start()
    try:
        worst = 0
        for frame in frames:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            check(frame, max_payload=MAX_PAYLOAD)
            worst = max(worst, tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    assert worst <= 2 * MAX_PAYLOAD


def _huge_claims() -> list[tuple[bytes, type]]:
    base, payload = split(CORPUS[0])  # Forward, raw, 1 x 8

    def lie(**kw: object) -> list:
        h = list(base)
        for k, v in kw.items():
            h[wire.Forward.__struct_fields__.index(k) + 1] = v
        return h

    zhead = bytes.fromhex("28b52ffd") + b"\xe0" + struct.pack("<Q", 2**40)  # claims 1 TiB
    return [
        (resign(lie(n_tokens=2**30, width=2**30, tokens=None, positions=None, rows=None), payload, True), FrameTooLarge),
        (resign(lie(payload_len=2**62, compression="zstd"), payload, True), FrameTooLarge),
        (resign(lie(compression="zstd", payload_len=len(zhead)), zhead, True), FrameError),
        (resign(lie(n_tokens=1, width=2**26 + 2), payload, True), FrameTooLarge),
        (PREFIX.pack(b"DGRF", 1, 0, 0, 2**32 - 1, 0), FrameTooLarge),
    ]


def _raw_header_frame(hb: bytes) -> bytes:
    poff = (16 + len(hb) + 63) // 64 * 64
    body = hb + bytes(poff - 16 - len(hb))
    return PREFIX.pack(b"DGRF", 1, 0, 0, len(hb), xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF) + body


@pytest.mark.parametrize("max_payload", [MAX_PAYLOAD, wire.MAX_PAYLOAD, 2**62])
def test_huge_declared_sizes_allocate_nothing(max_payload: int) -> None:
    claims = _huge_claims()
    for frame, exc in claims:
        with pytest.raises(exc):
            wire.decode(frame)
    frames = [f for f, _ in claims]
    frames += [
        _raw_header_frame(b"\x93\x01\x01\xdd\xff\xff\xff\xff"),  # tokens: array32 of 4G items
        _raw_header_frame(b"\x93\x01\x01\xdb\xff\xff\xff\xff"),  # model: str32 of 4 GiB
        _raw_header_frame(b"\xdd\xff\xff\xff\xff" + b"\x01" * 40),
    ]
    tracemalloc.start()
    try:
        for frame in frames:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            with pytest.raises(FrameError):
                wire.decode(frame, max_payload=max_payload)
            assert tracemalloc.get_traced_memory()[1] - base < 64 << 10
    finally:
        tracemalloc.stop()


def test_truncated_claims_are_truncation_errors() -> None:
    for frame in CORPUS[:4]:
        for cut in range(len(frame)):
            with pytest.raises(FrameTruncated):
                wire.decode(frame[:cut])


def test_tracemalloc_sees_what_decode_allocates() -> None:
    """Guards the allocation tests above: a real 64 KiB decode does show up."""
    a = np.zeros((16, 1024), np.float32)
    frame = wire.encode(wire.Forward(model="m", session="s", epoch=0, first_pos=0, n_tokens=16, layer=0), a, compress=True)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        f = wire.decode(frame)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(frame) < 1024 and f.array.nbytes <= peak < 2 * f.array.nbytes


# --- hypothesis: shrinking-friendly cases ------------------------------------------


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(data: bytes) -> None:
    check(data)


@SETTINGS
@given(st.binary(max_size=300), st.integers(0, 2**32 - 1), st.integers(0, 255), st.integers(0, 255))
def test_random_bytes_behind_a_valid_looking_prefix(rest: bytes, hlen: int, version: int, flags: int) -> None:
    check(PREFIX.pack(b"DGRF", version, flags, 0, hlen, 0) + rest)
    check(_raw_header_frame(rest))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=20,
)


@settings(SETTINGS, max_examples=150)
@given(
    st.sampled_from([1, 2, 3, 0, 4, -1, "1"]),
    st.lists(msgpack_values, max_size=24),
    st.binary(max_size=200),
    st.booleans(),
)
def test_random_headers(tag: object, fields: list, payload: bytes, fix: bool) -> None:
    check(resign([tag, *fields], payload, fix_checksum=fix), max_payload=MAX_PAYLOAD)


@SETTINGS
@given(st.data())
def test_one_field_lies(data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(SPLIT) - 1))
    header, payload = SPLIT[i]
    h = list(header)
    at = data.draw(st.integers(0, len(h) - 1))
    h[at] = data.draw(msgpack_values | st.sampled_from(LIES))
    check(resign(h, payload, fix_checksum=True), max_payload=MAX_PAYLOAD)
