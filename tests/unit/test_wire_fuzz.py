"""Fuzzing dgr.protocol.wire.decode: only FrameError escapes, and lies never buy an allocation."""

from __future__ import annotations

import random
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr.errors import FrameError, FrameTooLarge, FrameTruncated
from dgr.protocol import wire
from dgr.testing.wirefuzz import (
    CORPUS,
    LIES,
    PREFIX,
    SEED,
    SPLIT,
    mutate,
    resign,
    split,
)

SETTINGS = settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
MUTATED_INPUTS = 100_000
MAX_PAYLOAD = 64 << 10  # small, so that "no allocation beyond the limit" is measurable


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
