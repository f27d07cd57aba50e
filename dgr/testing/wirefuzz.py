"""Mutated wire frames for fuzzing a frame decoder (``tests/unit/test_wire_fuzz.py``) and a
live data-plane connection (``tests/integration/test_security.py``): valid frames of every
kind, codec and compression, and ``mutate(rng)``, each branch of which targets a different
layer of the decoder."""

from __future__ import annotations

import random
import struct

import msgspec
import numpy as np
import xxhash

from dgr.protocol import wire

__all__ = ["PREFIX", "SEED", "CORPUS", "LIES", "SPLIT", "corpus", "resign", "split", "mutate"]

PREFIX = struct.Struct("<4sBBHII")
SEED = 20240601


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
    # schema 4, speculative decoding: a verify step of a speculating decode loop (its last
    # two tokens drafts, two rejected positions rolled back first) and the Result it gets
    a = rng.standard_normal((3, 8), dtype=np.float32)
    hops = [wire.Hop(endpoint="10.0.0.2:7001"), wire.Hop(endpoint="10.0.0.3:7001", tokens=True)]
    out.append(wire.encode(wire.Forward(
        model="smollm2-135m-q4_1", session="sess-1", epoch=3, first_pos=20, n_tokens=3, layer=12,
        tokens=[7, 8, 9], want="token", sampling=samp, relay=hops[1:], reply_to="route-1",
        loop=[wire.Hop(endpoint="10.0.0.1:7001"), *hops], steps=30, stop_tokens=[2],
        rollback=2, drafts=2, speculate="ngram", max_draft=4), a))
    out.append(wire.encode(wire.Result(session="sess-1", epoch=3, first_pos=20, n_tokens=3,
                                       tokens=[8, 11], drafted=2)))
    return out


CORPUS = corpus()

LIES: list[object] = [
    0, 1, -1, 2, 7, 63, 64, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1,
    2**63, 2**64 - 1, -(2**63), 0.5, -0.0, float("nan"), float("inf"), "", "raw", "f16", "bf16",
    "q8", "zstd", "none", "f32", "f64", "logits", "boundary", "token", "x" * 300, None, True,
    False, [], [0], [2**31], [-1], list(range(70)), [None], {}, {"a": 1}, b"\x00" * 8, [1.0, 0, 1.0, 0, False],
]


def resign(header, payload: bytes, fix_checksum: bool) -> bytes:
    """Re-encode a (mutated) header (a list, or anything msgpack encodes) with valid prefix
    and, optionally, payload checksum."""
    tag = header[0] if isinstance(header, list) and header else None
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
