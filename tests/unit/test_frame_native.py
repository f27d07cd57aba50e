"""The C++ frame codec (dgr._core._frame, cpp/src/frame.cpp) against dgr.protocol.wire.

Fuzzed with a fixed seed: valid frames from ``wire.encode`` with random fields, and mutations
of them (truncation, trailing bytes, bit flips, bad prefix fields, lies in header fields with
the checksums fixed up, malformed msgpack, huge declared sizes). For every input both
decoders must agree: the same accept/reject and error code (and, for a cross-field rule, the
same message), the same fields and array bytes;
the C++ side may only answer ``FrameNotNative`` (decode it in Python) for a frame whose codec
is not raw or which is compressed. ``encode_frame`` must give ``wire.encode``'s bytes.
"""

from __future__ import annotations

import copy
import re
import struct

import msgspec
import numpy as np
import pytest
import xxhash

from dgr import errors
from dgr.errors import FrameError, FrameNotNative
from dgr.protocol import wire

_frame = pytest.importorskip("dgr._core._frame", reason="the compiled core is not built")

SEED = 20261201
PREFIX = struct.Struct("<4sBBHII")
SMALL_LIMITS = {"max_payload": 4096, "max_header": 512}

# Values that sit on msgpack width boundaries and on the wire's range limits.
INTS = [0, 1, 2, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
        2**63 - 1, 2**63, 2**64 - 1]
LIES: list[object] = [
    *INTS, -1, -32, -33, -129, -(2**31), -(2**63), 0.0, -0.0, 0.5, 1.0, 1.0000001, 2.5,
    float("nan"), float("inf"), float("-inf"), "", "f32", "f16", "raw", "bf16", "q8", "zstd",
    "none", "lz4", "boundary", "logits", "token", "token+logits", "x" * 40, "é" * 20, None, True,
    False, [], [0], [1, 2], [2**31], [-1], [None], [0.5], list(range(20)), {}, {"a": 1}, b"\x00",
    [1.0, 0, 1.0, 0, False], [[]], [["h:1", True]], [["h:1", 1]], [{"endpoint": "h"}],
    *(msgspec.msgpack.Ext(5, b"e" * n) for n in (0, 1, 2, 3, 4, 8, 16, 300, 70000)), b"b" * 300,
    [[1, [2, {"k": [3.5, None]}]]], {"k": {"j": b"\x00"}},
]

#: Lies for the items of nested values (Sampling, Hop, id lists): fewer, on their range limits.
NESTED_LIES: list[object] = [-1, 0, 1, 2**31 - 1, 2**31, 2**63, 2**64 - 1, 0.0, -0.0, 1.0,
                             1.0000001, 1e-300, -1e-300, float("nan"), float("inf"), None, True,
                             False, "", "a", [], {}, msgspec.msgpack.Ext(1, b"12345678")]


def pick(rng: np.random.Generator, seq: list | tuple) -> object:
    """One item of ``seq`` as it is (``rng.choice`` would turn big ints into floats)."""
    return seq[int(rng.integers(0, len(seq)))]


def rand_str(rng: np.random.Generator) -> str:
    n = pick(rng, [0, 1, 5, 31, 32, 255, 256, 300])
    alphabet = "abcXYZ:-_0123456789é中😀"
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), n))


def rand_int(rng: np.random.Generator, hi: int) -> int:
    choices = [v for v in INTS if v <= hi]
    return pick(rng, choices) if rng.random() < 0.5 else int(rng.integers(0, min(hi, 2**62) + 1))


def rand_hops(rng: np.random.Generator) -> list[wire.Hop]:
    return [wire.Hop(endpoint=rand_str(rng), tokens=bool(rng.random() < 0.5))
            for _ in range(pick(rng, [0, 1, 2, 3]))]


def rand_forward(rng: np.random.Generator) -> tuple[wire.Forward, np.ndarray | None]:
    """A valid Forward and its array (None: a token-only first-stage step)."""
    n = pick(rng, [1, 1, 2, 15, 16, 17, 64])
    first = rand_int(rng, 2**31 - n)
    width = pick(rng, [0, 8, 576]) if n <= 16 else pick(rng, [0, 8])
    tokens = [rand_int(rng, 2**31 - 1) for _ in range(n)] if width == 0 or rng.random() < 0.3 else None
    positions = [first] + [rand_int(rng, 2**31 - 1) for _ in range(n - 1)] if rng.random() < 0.3 else None
    want = pick(rng, wire.WANTS)
    rows = sorted({int(r) for r in rng.integers(0, n, int(rng.integers(1, 4)))}) if rng.random() < 0.3 else None
    rows = None if want == "embedding" else rows  # an embedding step returns every row
    sampling = None
    if rng.random() < 0.4:
        temperature = pick(rng, [0.0, 0.7, 1.0, 1e300, float("inf")])
        top_k = rand_int(rng, 2**31 - 1)
        top_p = pick(rng, [1.0, 0.95, 1e-300])
        seed = rand_int(rng, 2**64 - 1)
        greedy = bool(rng.random() < 0.5)
        # min_p and the logit bias from the seed drawn (more draws would change every later
        # frame of the stream)
        sampling = wire.Sampling(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, greedy=greedy,
            min_p=(0.0, 0.05, 1.0)[seed % 3], penalty_last_n=seed % 100,
            repeat_penalty=(1.0, 1.3, 1e-300)[seed % 5 % 3],
            frequency_penalty=(0.0, -2.0, 1e300)[seed % 7 % 3], presence_penalty=0.5,
            grammar=("", '{"grammars": []}', "é" * 3)[seed % 11 % 3], grammar_id=seed // 3,
            grammar_from=seed % 1000,
            **({} if seed % 2 else dict(bias_ids=(seed % 2**31, 0, 2**31 - 1),
                                        bias=(-100.0, float("-inf"), 2.5))))
    relay = rand_hops(rng) if rng.random() < 0.4 else None
    reply_to = rand_str(rng) or "r" if relay is not None or rng.random() < 0.3 else ""
    loop, steps = None, 0
    if rng.random() < 0.3 and want.startswith("token") and rows is None:
        loop = rand_hops(rng) or [wire.Hop(endpoint="a:1")]
        steps = rand_int(rng, 2**31 - 1)
        reply_to = reply_to or "r"
    stop = [rand_int(rng, 2**31 - 1) for _ in range(int(rng.integers(0, 4)))] if rng.random() < 0.3 else None
    # schema 4, speculative decoding: drafts need a token want, rows None and a token first
    drafts = 0
    if n > 1 and want.startswith("token") and rows is None and rng.random() < 0.4:
        drafts = int(rng.integers(1, min(n - 1, wire.MAX_DRAFT) + 1))
    spec = {"rollback": rand_int(rng, 2**31 - 1) if rng.random() < 0.3 else 0, "drafts": drafts,
            "speculate": pick(rng, wire.DRAFTERS),
            "max_draft": int(rng.integers(0, wire.MAX_DRAFT + 1)) if rng.random() < 0.4 else 0}
    h = wire.Forward(
        schema=pick(rng, [1, 2, 3, 4, 2**64 - 1]) if rng.random() < 0.2 else wire.SCHEMA_VERSION,
        model=rand_str(rng), session=rand_str(rng), epoch=rand_int(rng, 2**63 - 1), first_pos=first,
        n_tokens=n, layer=rand_int(rng, 2**31 - 1), positions=positions, tokens=tokens, want=want,
        rows=rows, sampling=sampling, relay=relay, reply_to=reply_to, loop=loop, steps=steps,
        stop_tokens=stop, solo=bool(rng.random() < 0.3), **spec)
    array = rng.standard_normal((n, width), dtype=np.float32) if width else None
    return h, array


def rand_result(rng: np.random.Generator) -> tuple[wire.Result, np.ndarray | None]:
    kind = pick(rng, wire.RESULT_KINDS)
    rows, cols = (0, 0) if kind == "none" else (pick(rng, [1, 2, 16]), pick(rng, [1, 8, 576]))
    h = wire.Result(
        session=rand_str(rng), epoch=rand_int(rng, 2**63 - 1), first_pos=rand_int(rng, 2**31 - 1),
        n_tokens=rand_int(rng, 2**31 - 1), kind=kind, layer=rand_int(rng, 2**31 - 1),
        tokens=[rand_int(rng, 2**31 - 1) for _ in range(int(rng.integers(0, 3)))] if rng.random() < 0.5 else None,
        drafted=rand_int(rng, 2**31 - 1) if rng.random() < 0.3 else 0)
    array = rng.standard_normal((rows, cols), dtype=np.float32) if rows else None
    if array is not None and rng.random() < 0.1:  # bit patterns the raw codec keeps exactly
        array.reshape(-1).view(np.uint32)[:1] = rng.choice([0x7FC00001, 0x80000000, 0x00000001])
    return h, array


def rand_other(rng: np.random.Generator) -> wire.Message:
    if rng.random() < 0.5:
        return wire.Hello(route=rand_str(rng))
    return wire.ErrorReply(code=rand_int(rng, 2**31 - 1), message=rand_str(rng), session=rand_str(rng),
                           epoch=rand_int(rng, 2**63 - 1),
                           retry_after=pick(rng, [0.0, 0.5, 1e9]) if rng.random() < 0.5 else None)


# --- frame surgery ------------------------------------------------------------------


def split(frame: bytes) -> tuple[bytes, bytes]:
    """(msgpack header, payload) of a valid frame."""
    hlen = PREFIX.unpack_from(frame)[4]
    poff = -(-(16 + hlen) // 64) * 64
    return frame[16:16 + hlen], frame[poff:]


def build(hb: bytes, payload: bytes, version: int = 1, flags: int = 0, reserved: int = 0) -> bytes:
    """A frame around header bytes ``hb``, its header checksum fixed up."""
    body = hb + bytes(-(16 + len(hb)) % 64)
    hsum = xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF
    return PREFIX.pack(b"DGRF", version, flags, reserved, len(hb), hsum) + body + payload


def mutate(rng: np.random.Generator, frame: bytes) -> bytes:
    """One random corruption of a valid frame."""
    hb, payload = split(frame)
    kind = int(rng.integers(0, 13))
    b = bytearray(frame)
    if kind == 0:  # truncation
        return frame[: int(rng.integers(0, len(frame)))]
    if kind == 1:  # trailing bytes
        return frame + bytes(pick(rng, [1, 3, 64]))
    if kind == 2:  # bit flips anywhere (mostly checksum errors)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
        return bytes(b)
    if kind == 3:  # prefix fields: magic, version, flags, reserved, header_len
        field = int(rng.integers(0, 5))
        if field == 0:
            b[int(rng.integers(0, 4))] ^= 0x20
        elif field == 1:
            b[4] = pick(rng, [0, 2, 255])
        elif field == 2:
            b[5] = pick(rng, [1, 0x80])
        elif field == 3:
            b[6 + int(rng.integers(0, 2))] = 1
        else:
            b[8:12] = struct.pack("<I", pick(rng, [0, 1, len(hb) - 1, len(hb) + 1, 2**20, 2**20 + 1,
                                                        2**32 - 1]))
        return bytes(b)
    if kind in (4, 5, 6):  # a header field replaced by a lie, checksums fixed up
        items = msgspec.msgpack.decode(hb)
        i = int(rng.integers(1, len(items) + 1))
        lie = copy.deepcopy(pick(rng, LIES))
        if i == len(items):
            items.append(lie)  # an unknown trailing item: must be ignored
        else:
            items[i] = lie
        return build(msgspec.msgpack.encode(items), payload)
    if kind == 7:  # the header array cut short or grown, with junk of every msgpack type
        items = msgspec.msgpack.decode(hb)
        if rng.random() < 0.5:
            items = items[: int(rng.integers(0, len(items)))]
        else:
            items += [copy.deepcopy(LIES[int(j)]) for j in rng.integers(0, len(LIES), int(rng.integers(1, 20)))]
        return build(msgspec.msgpack.encode(items), payload)
    if kind == 8:  # raw header bytes flipped, inserted or deleted, header checksum fixed up
        h = bytearray(hb)
        for _ in range(int(rng.integers(1, 3))):
            op, i = int(rng.integers(0, 3)), int(rng.integers(0, len(h)))
            if op == 0:
                h[i] ^= 1 << int(rng.integers(0, 8))
            elif op == 1:
                h.insert(i, int(rng.integers(0, 256)))
            elif len(h) > 1:
                del h[i]
        return build(bytes(h), payload)
    if kind == 9:  # huge declared sizes in width / rows / cols / payload_len
        items = msgspec.msgpack.decode(hb)
        idx = {1: [8, 6, 13], 2: [8, 9, 14]}.get(items[0], [1])
        items[pick(rng, idx)] = pick(rng, [2**20, 2**31 - 1, 2**63 - 1, 1025, 4097])
        return build(msgspec.msgpack.encode(items), payload)
    if kind == 10:  # a payload byte flipped, the header checksum still right
        if not payload:
            return frame + b"\x00"
        p = bytearray(payload)
        p[int(rng.integers(0, len(p)))] ^= 0x01
        return build(hb, bytes(p))
    if kind == 11:  # a lie inside a nested value (sampling, a hop, a list), checksums fixed up
        items = msgspec.msgpack.decode(hb)
        nested: list[list] = []

        def walk(x: object, depth: int) -> None:
            if isinstance(x, list):
                nested.append(x)
                for y in x if depth < 2 else ():
                    walk(y, depth + 1)

        for x in items[1:]:
            walk(x, 0)
        structs = [x for x in nested if x and not all(type(y) is int for y in x)]  # Sampling, Hops
        if structs and rng.random() < 0.7:
            nested = structs
        if nested:
            c = pick(rng, nested)
            lie = copy.deepcopy(pick(rng, NESTED_LIES if rng.random() < 0.7 else LIES))
            if c and rng.random() < 0.6:
                c[int(rng.integers(0, len(c)))] = lie
            else:
                c.append(lie)
        return build(msgspec.msgpack.encode(items), payload)
    # kind 12: the message type changed (tag), checksums fixed up
    items = msgspec.msgpack.decode(hb)
    items[0] = pick(rng, [0, 1, 2, 3, 4, 5, 255])
    return build(msgspec.msgpack.encode(items), payload)


# --- comparison ---------------------------------------------------------------------


def as_fields(h: wire.Message) -> dict:
    """``h`` in the shape decode_frame returns."""
    out: dict = {"type": type(h).__name__}
    for name in h.__struct_fields__:
        v = getattr(h, name)
        if isinstance(v, wire.Sampling):
            v = {f: getattr(v, f) for f in v.__struct_fields__}
        elif name in ("relay", "loop") and v is not None:
            v = [{"endpoint": hop.endpoint, "tokens": hop.tokens} for hop in v]
        out[name] = v
    return out


#: The messages of the cross-field rules (wire._check_forward / _check_result), which the
#: C++ decoder words exactly as wire.decode does; the other rules' messages are its own.
CROSS_FIELD = re.compile(r"(unknown )?(Forward|Result)\.|Forward carries neither")
#: cross-field rejections whose messages were compared (the fuzz must reach some)
compared = {"n": 0}


def same_message(py_msg: str, c_msg: str) -> None:
    """A cross-field rejection has the same message on both sides. The one documented
    difference (cpp/include/dgr/frame.h): a quoted value's character above U+00FF that
    Python's repr() escapes as not printable stays as it is in C++."""
    if not CROSS_FIELD.match(py_msg):
        return
    if any(ord(c) > 0xFF and not c.isprintable() for c in c_msg):
        return
    assert c_msg == py_msg
    compared["n"] += 1


def check_frame_agrees(buf: object, limits: dict, py: wire.Frame | None, py_code: int,
                       py_msg: str = "") -> None:
    """``_frame.decode`` (the worker's data plane: a ``wire.Frame``) against ``wire.decode``:
    the same outcome, and a header of the same class with the same msgpack bytes (stricter
    than ``==``: True is not 1, and a NaN equals itself), the same array bytes, as a view."""
    try:
        nf = _frame.decode(buf, **limits)
    except FrameNotNative:
        assert py_code in (0, errors.FrameError.code)
        return
    except FrameError as e:
        assert e.code == py_code, (e.code, py_code, bytes(buf)[:200])
        same_message(py_msg, str(e))
        return
    assert py_code == 0, (py_code, bytes(buf)[:200])
    assert type(nf) is wire.Frame and type(nf.header) is type(py.header)
    assert msgspec.msgpack.encode(nf.header) == msgspec.msgpack.encode(py.header)
    if py.array is None:
        assert nf.array is None
    else:
        assert nf.array.tobytes() == py.array.tobytes() and not nf.array.flags.writeable
        assert np.shares_memory(nf.array, np.frombuffer(buf, np.uint8))


def check_agree(buf: object, limits: dict) -> str:
    """Both decoders on ``buf``; returns how they agreed (for coverage counts)."""
    py_msg = ""
    try:
        py = wire.decode(buf, **limits)
        py_code = 0
    except FrameError as e:
        py, py_code, py_msg = None, e.code, str(e)
    check_frame_agrees(buf, limits, py, py_code, py_msg)
    try:
        fields, arr = _frame.decode_frame(buf, **limits)
        c_code = 0
    except FrameNotNative:
        # checked up to the payload checksum: only a codec/zstd frame may end here, and
        # Python then accepts it or finds fault in the codec's own payload (FrameError)
        assert py_code in (0, errors.FrameError.code), bytes(buf)[:64]
        h = msgspec.msgpack.decode(split(bytes(buf))[0])
        codec, comp = (h[11], h[12]) if h[0] == 1 else (h[12], h[13])
        assert codec != "raw" or comp != "none"
        return "fallback"
    except FrameError as e:
        c_code = e.code
        same_message(py_msg, str(e))
    assert c_code == py_code, (c_code, py_code, bytes(buf)[:200])
    if py_code:
        return f"reject-{py_code}"
    assert fields == as_fields(py.header)
    if py.array is None:
        assert arr is None
    else:
        assert arr.dtype == np.dtype("<f4") and arr.shape == py.array.shape
        assert arr.tobytes() == py.array.tobytes()  # bit for bit (NaN payloads, -0)
        assert not arr.flags.writeable
        assert np.shares_memory(arr, np.frombuffer(buf, np.uint8))  # a view, not a copy
    return f"accept-{fields['type']}"


def valid_frames(rng: np.random.Generator, count: int) -> list[tuple[wire.Message, np.ndarray | None, bytes]]:
    out = []
    for i in range(count):
        r = i % 10
        if r < 5:
            h, a = rand_forward(rng)
        elif r < 9:
            h, a = rand_result(rng)
        else:
            h, a = rand_other(rng), None
        codec, compress = "raw", False
        # another codec only for finite rows (q8 refuses a NaN: that is not a valid frame)
        if a is not None and rng.random() < 0.1 and np.isfinite(a).all():
            codec, compress = pick(rng, wire.CODECS), bool(rng.random() < 0.5)
        out.append((h, a, wire.encode(h, a, codec=codec, compress=compress)))
    return out


def test_decoders_agree_on_valid_and_mutated_frames():
    """Same accept/reject, error code, fields and array bytes, on ~8000 fuzzed frames."""
    rng = np.random.default_rng(SEED)
    frames = valid_frames(rng, 1500)
    compared["n"] = 0
    seen: dict[str, int] = {}
    for _, _, frame in frames:
        k = check_agree(frame, {})
        seen[k] = seen.get(k, 0) + 1
    for j in range(6500):
        frame = frames[int(rng.integers(0, len(frames)))][2]
        bad = mutate(rng, frame)
        limits = SMALL_LIMITS if j % 5 == 0 else {}
        k = check_agree(bad if j % 7 else bytearray(bad), limits)
        seen[k] = seen.get(k, 0) + 1
    # The fuzz reached every outcome it is meant to cover.
    for k in ("accept-Forward", "accept-Result", "accept-ErrorReply", "accept-Hello", "fallback",
              "reject-20", "reject-21", "reject-22", "reject-23", "reject-24", "reject-25"):
        assert seen.get(k, 0) >= 5, (k, seen)
    assert compared["n"] >= 50, compared  # cross-field rejections, their messages compared


def test_encoders_give_the_same_bytes():
    """encode_frame == wire.encode for random valid Forward/Result headers (raw codec)."""
    rng = np.random.default_rng(SEED + 1)
    n = 0
    for _ in range(1500):
        h, a = rand_forward(rng) if rng.random() < 0.5 else rand_result(rng)
        assert _frame.encode_frame(h, a) == wire.encode(h, a)
        n += a is not None
    assert n > 500


def _encode_outcome(fn, h, a) -> object:
    try:
        return fn(h, a)
    except errors.DgrError as e:
        return type(e)


BAD_ENCODES = [
    # (header, array shape or None): each breaks one of _prepare's rules
    ({"tokens": [1, 2]}, None),                              # tokens length vs n_tokens
    ({"tokens": [1], "rows": []}, None),                         # empty rows
    ({"tokens": [1], "rows": [1]}, None),                        # row out of range
    ({"tokens": [1], "want": "all"}, None),                      # unknown want
    ({"tokens": [1], "relay": []}, None),                        # relay without reply_to
    ({"tokens": [1], "steps": 2, "reply_to": "r"}, None),           # loop missing
    ({"tokens": [1], "steps": 2, "reply_to": "r", "loop": [wire.Hop(endpoint="a")]}, None),  # want boundary
    ({"tokens": [1], "positions": [3]}, None),                   # positions[0] vs first_pos
    ({"first_pos": 2**31 - 1, "n_tokens": 2, "tokens": [1, 2]}, None),  # positions overflow
    ({}, None),                                            # neither boundary nor tokens
    ({"width": 8}, None),                                     # width without array
    ({}, (2, 8)),                                          # rows vs n_tokens
    ({"width": 4}, (1, 8)),                                   # width vs array
    ({}, (1, 0)),                                          # empty width
]


@pytest.mark.parametrize("fields,shape", BAD_ENCODES)
def test_encoders_refuse_the_same_forwards(fields, shape):
    base = {"model": "m", "session": "s", "epoch": 1, "first_pos": 0, "n_tokens": 1, "layer": 0}
    h = wire.Forward(**{**base, **fields})
    a = None if shape is None else np.zeros(shape, np.float32)
    py = _encode_outcome(wire.encode, h, a)
    assert isinstance(py, type) and issubclass(py, errors.DgrError)
    assert _encode_outcome(_frame.encode_frame, h, a) is py


@pytest.mark.parametrize("fields,shape", [
    ({"kind": "none"}, (1, 8)), ({"kind": "logits"}, None), ({"kind": "odd"}, None),
    ({"kind": "logits"}, (0, 8)), ({"kind": "none", "rows": 1, "cols": 1}, None),
])
def test_encoders_refuse_the_same_results(fields, shape):
    h = wire.Result(**{"session": "s", "epoch": 1, "first_pos": 0, "n_tokens": 1, **fields})
    a = None if shape is None else np.zeros(shape, np.float32)
    py = _encode_outcome(wire.encode, h, a)
    assert isinstance(py, type) and issubclass(py, errors.DgrError)
    assert _encode_outcome(_frame.encode_frame, h, a) is py


def test_boundary_is_a_read_only_view_that_pins_the_buffer():
    """No copy: the array points into the frame, and a bytearray cannot be resized under it."""
    a = np.arange(576, dtype=np.float32).reshape(1, 576)
    frame = bytearray(wire.encode(wire.Forward(model="m", session="s", epoch=0, first_pos=0,
                                               n_tokens=1, layer=4), a))
    fields, arr = _frame.decode_frame(frame)
    assert fields["width"] == 576 and np.array_equal(arr, a)
    assert not arr.flags.writeable
    frame[-4:] = b"\x00\x00\x80\x7f"  # the frame's bytes change under the view (+inf)
    assert arr[0, -1] == np.inf
    with pytest.raises(BufferError):
        frame.extend(b"x")


def test_non_buffers_are_frame_errors():
    for bad in ("DGRF", 7, None, np.zeros((4, 4), np.uint8)[:, ::2]):
        with pytest.raises(FrameError) as py:
            wire.decode(bad)
        with pytest.raises(FrameError) as c:
            _frame.decode_frame(bad)
        assert type(c.value) is type(py.value)


def _bases() -> list[bytes]:
    """Valid frames with every optional field set (the systematic lies start from these)."""
    samp = wire.Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=2**63, greedy=True)
    hops = [wire.Hop(endpoint="h1:1", tokens=True), wire.Hop(endpoint="h2:2")]
    a = np.ones((2, 8), np.float32)
    f1 = wire.Forward(model="m", session="s", epoch=5, first_pos=7, n_tokens=2, layer=3,
                      positions=[7, 9], tokens=[1, 2], want="logits", rows=[0, 1], sampling=samp,
                      relay=hops, reply_to="r", stop_tokens=[2, 3], solo=True)
    f2 = wire.Forward(model="m", session="s", epoch=5, first_pos=7, n_tokens=2, layer=3,
                      tokens=[1, 2], want="token", sampling=samp, relay=hops[1:], reply_to="r",
                      loop=hops, steps=3)
    f3 = wire.Forward(model="m", session="s", epoch=5, first_pos=7, n_tokens=2, layer=3,
                      tokens=[1, 2], want="token+logits", sampling=samp, relay=hops[1:],
                      reply_to="r", loop=hops, steps=3, rollback=2, drafts=1, speculate="mtp",
                      max_draft=4)
    r = wire.Result(session="s", epoch=5, first_pos=7, n_tokens=2, kind="boundary", layer=4,
                    tokens=[9, 4], drafted=1)
    return [wire.encode(f1, a), wire.encode(f1), wire.encode(f2), wire.encode(f3, a),
            wire.encode(f3), wire.encode(r, a),
            wire.encode(wire.Result(session="s", epoch=1, first_pos=0, n_tokens=1)),
            wire.encode(wire.ErrorReply(code=34, message="busy", session="s", epoch=2, retry_after=0.5)),
            wire.encode(wire.Hello(route="r"))]


def test_decoders_agree_on_every_lie_in_every_field():
    """Each header field, and each item of a nested value, replaced by each lie in turn."""
    n = 0
    for frame in _bases():
        hb, payload = split(frame)
        items = msgspec.msgpack.decode(hb)
        for i in range(1, len(items) + 1):  # len(items): a trailing unknown item
            for lie in LIES:
                mutated = copy.deepcopy(items)
                mutated[i:i + 1] = [copy.deepcopy(lie)]
                check_agree(build(msgspec.msgpack.encode(mutated), payload), {})
                n += 1
            if i == len(items) or not isinstance(items[i], list):
                continue
            paths = [(j,) for j in range(len(items[i]) + 1)]  # + 1: a trailing item
            paths += [(j, k) for j, x in enumerate(items[i]) if isinstance(x, list)
                      for k in range(len(x) + 1)]
            for path in paths:
                for lie in NESTED_LIES:
                    mutated = copy.deepcopy(items)
                    c = mutated[i]
                    for step in path[:-1]:
                        c = c[step]
                    c[path[-1]:path[-1] + 1] = [copy.deepcopy(lie)]
                    check_agree(build(msgspec.msgpack.encode(mutated), payload), {})
                    n += 1
    assert n > 3000


#: UTF-8 edge cases, valid and not (surrogates, overlongs, beyond U+10FFFF, cut sequences).
UTF8_EDGES = [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xed\x9f\xbf", b"\xee\x80\x80", b"\xc0\x80",
              b"\xc1\xbf", b"\xc2\x80", b"\xe0\x9f\xbf", b"\xe0\xa0\x80", b"\xf0\x8f\xbf\xbf",
              b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80",
              b"\xff", b"\x80", b"\xe2\x82", b"a\xf0\x9f\x98", b"\xf0\x9f\x98\x80", b"\x00", b"\x7f"]
_MARK = "\x01mark\x01"


def test_decoders_agree_on_utf8_edges_in_every_string():
    """Each string field (and hop endpoint) holding raw bytes that may not be UTF-8."""
    mark = msgspec.msgpack.encode(_MARK)
    n = 0
    for frame in _bases():
        hb, payload = split(frame)
        items = msgspec.msgpack.decode(hb)
        slots = [(i,) for i, x in enumerate(items) if type(x) is str]
        slots += [(i, j, 0) for i, x in enumerate(items) if type(x) is list
                  for j, y in enumerate(x) if type(y) is list and y and type(y[0]) is str]
        for path in slots:
            mutated = copy.deepcopy(items)
            c = mutated
            for step in path[:-1]:
                c = c[step]
            c[path[-1]] = _MARK
            enc = msgspec.msgpack.encode(mutated)
            assert enc.count(mark) == 1
            for raw in UTF8_EDGES:
                check_agree(build(enc.replace(mark, bytes([0xA0 | len(raw)]) + raw), payload), {})
                n += 1
    assert n > 300


def test_decoders_agree_at_the_size_limits():
    """max_payload and max_header at, just below and just above what each frame needs."""
    rng = np.random.default_rng(SEED + 2)
    a = rng.standard_normal((3, 40), dtype=np.float32)
    h = wire.Forward(model="m", session="s", epoch=1, first_pos=0, n_tokens=3, layer=2)
    n = 0
    for codec in wire.CODECS:
        for compress in (False, True):
            frame = wire.encode(h, a, codec=codec, compress=compress)
            hb, payload = split(frame)
            sizes = {len(payload), wire.payload_size(codec, 3, 40), 4 * 3 * 40}
            for size in sizes:
                for mp in (size - 1, size, size + 1):
                    for mh in (len(hb) - 1, len(hb)):
                        check_agree(frame, {"max_payload": mp, "max_header": mh})
                        n += 1
    assert n > 50


# --- schema 4: speculative decoding (Forward.rollback / drafts / speculate / max_draft,
# Result.drafted) -----------------------------------------------------------------------

FORWARD_ITEM = {name: 1 + i for i, name in enumerate(wire.Forward.__struct_fields__)}
RESULT_ITEM = {name: 1 + i for i, name in enumerate(wire.Result.__struct_fields__)}
SPEC_BASE = {"model": "m", "session": "s", "epoch": 1, "first_pos": 4, "n_tokens": 3,
             "layer": 0, "tokens": [5, 6, 7], "want": "token"}


def _relabelled(h: wire.Message, items: dict, fields: dict, payload: bytes = b"") -> bytes:
    """``h``'s frame with header items replaced (by field name), re-signed: frames that
    ``wire.encode`` refuses to write."""
    hb, _ = split(wire.encode(h))
    lst = msgspec.msgpack.decode(hb)
    for name, v in fields.items():
        lst[items[name]] = v
    return build(msgspec.msgpack.encode(lst), payload)


def _both(frame: bytes) -> tuple[object, object]:
    """(wire.decode's outcome, _frame.decode's): the header, or (error class, message)."""
    out = []
    for dec in (wire.decode, _frame.decode):
        try:
            out.append(dec(frame).header)
        except FrameError as e:
            out.append((type(e), str(e)))
    return out[0], out[1]


@pytest.mark.parametrize("fields", [
    {"rollback": 5}, {"rollback": 2**31 - 1}, {"drafts": 2}, {"drafts": 1, "want": "token+logits"},
    {"speculate": "ngram"}, {"speculate": "mtp"}, {"max_draft": wire.MAX_DRAFT},
    {"rollback": 1, "drafts": 2, "speculate": "ngram", "max_draft": 8},
    {"n_tokens": 33, "tokens": list(range(33)), "drafts": 32},
])
def test_the_speculative_fields_decode_alike(fields):
    """A Forward setting each schema-4 field: both decoders accept it, with equal headers,
    and the C++ encoder writes wire.encode's bytes."""
    h = wire.Forward(**{**SPEC_BASE, **fields})
    frame = wire.encode(h)
    assert _frame.encode_frame(h) == frame
    py, c = _both(frame)
    assert type(py) is wire.Forward and c == py
    assert py == msgspec.structs.replace(h, checksum=py.checksum)  # the encoder fills it
    assert check_agree(frame, {}) == "accept-Forward"


@pytest.mark.parametrize("fields,message", [
    ({"drafts": 3}, "Forward.drafts is 3 but n_tokens is 3 (a draft follows a token)"),
    ({"drafts": 5}, "Forward.drafts is 5 but n_tokens is 3 (a draft follows a token)"),
    ({"drafts": 1, "want": "boundary"},
     "Forward.drafts asks the last stage to verify: want a token, rows None"),
    ({"drafts": 1, "want": "logits"},
     "Forward.drafts asks the last stage to verify: want a token, rows None"),
    ({"drafts": 1, "rows": [2]},
     "Forward.drafts asks the last stage to verify: want a token, rows None"),
    ({"speculate": "eagle"}, "unknown Forward.speculate 'eagle' (known: ngram, mtp)"),
    ({"speculate": "it's"}, 'unknown Forward.speculate "it\'s" (known: ngram, mtp)'),
    ({"speculate": "\t\x7f\xa0é中"},
     "unknown Forward.speculate '\\t\\x7f\\xa0é中' (known: ngram, mtp)"),
    ({"max_draft": 33}, "Forward.max_draft / drafts may be at most 32"),
    ({"n_tokens": 40, "tokens": list(range(40)), "drafts": 33},
     "Forward.max_draft / drafts may be at most 32"),
])
def test_the_speculative_rules_refuse_alike(fields, message):
    """Each cross-field rule of the schema-4 fields broken: both decoders refuse the frame
    with FrameError and the same message, both encoders with InvalidArgument and that
    message."""
    h = wire.Forward(**{**SPEC_BASE, **fields})
    for enc in (wire.encode, _frame.encode_frame):
        with pytest.raises(errors.InvalidArgument) as e:
            enc(h)
        assert str(e.value) == message
    frame = _relabelled(wire.Forward(**SPEC_BASE), FORWARD_ITEM,
                        {k: v for k, v in fields.items()})
    py, c = _both(frame)
    assert py == c == (FrameError, message)
    assert check_agree(frame, {}) == "reject-20"


@pytest.mark.parametrize("field,lie", [
    ("rollback", -1), ("rollback", 2**31), ("rollback", "1"), ("rollback", None),
    ("drafts", -1), ("drafts", 2**31), ("drafts", True), ("drafts", 1.0),
    ("speculate", None), ("speculate", 0), ("speculate", b"mtp"), ("speculate", ["mtp"]),
    ("max_draft", -1), ("max_draft", 2**63), ("max_draft", False),
])
def test_the_speculative_fields_type_and_range_alike(field, lie):
    """A schema-4 field of the wrong type or out of the i32 range: refused by both
    decoders (FrameError at the header's types, before any cross-field rule)."""
    frame = _relabelled(wire.Forward(**SPEC_BASE), FORWARD_ITEM, {field: lie})
    py, c = _both(frame)
    assert type(py) is tuple and py[0] is FrameError and c[0] is FrameError
    assert f"(Forward.{field})" in py[1]
    assert check_agree(frame, {}) == "reject-20"


def test_a_schema_3_sender_gets_the_defaults():
    """A Forward and a Result without the schema-4 items (an older sender's, schema 3): both
    decoders fill the defaults; one more trailing item after them is ignored."""
    fh, _ = split(wire.encode(wire.Forward(**SPEC_BASE)))
    rh, _ = split(wire.encode(wire.Result(session="s", epoch=1, first_pos=4, n_tokens=1)))
    for hb, cut in ((fh, FORWARD_ITEM["rollback"]), (rh, RESULT_ITEM["drafted"])):
        items = msgspec.msgpack.decode(hb)
        old = items[:cut]
        old[1] = 3
        py, c = _both(build(msgspec.msgpack.encode(old), b""))
        assert py == c and py.schema == 3
        if type(py) is wire.Forward:
            assert (py.rollback, py.drafts, py.speculate, py.max_draft) == (0, 0, "", 0)
        else:
            assert py.drafted == 0
        newer = items + ["a schema-5 field"]
        py, c = _both(build(msgspec.msgpack.encode(newer), b""))
        assert py == c == wire.decode(build(hb, b"")).header


def test_a_result_with_drafted_round_trips_natively():
    """Result.drafted: the C++ encoder writes wire.encode's bytes (item 17) and the C++
    decoder reads it back, with and without an array."""
    a = np.arange(8, dtype=np.float32).reshape(1, 8)
    for r, arr in ((wire.Result(session="s", epoch=2, first_pos=9, n_tokens=4, tokens=[3, 1, 4],
                                drafted=3), None),
                   (wire.Result(session="s", epoch=2, first_pos=9, n_tokens=4, kind="logits",
                                tokens=[3, 1], drafted=2**31 - 1), a)):
        frame = _frame.encode_frame(r, arr)
        assert frame == wire.encode(r, arr)
        hb, _ = split(frame)
        assert msgspec.msgpack.decode(hb)[RESULT_ITEM["drafted"]] == r.drafted
        back = _frame.decode(frame)
        assert back.header == wire.decode(frame).header and back.header.drafted == r.drafted
        fields, _ = _frame.decode_frame(frame)
        assert fields["drafted"] == r.drafted
        head, payload = _frame.encode_head(r, arr)
        assert bytes(head) + (b"" if payload is None else payload.tobytes()) == frame
    for lie in (-1, 2**31, "3", None):
        frame = _relabelled(wire.Result(session="s", epoch=2, first_pos=9, n_tokens=4),
                            RESULT_ITEM, {"drafted": lie})
        py, c = _both(frame)
        assert py[0] is c[0] is FrameError and "(Result.drafted)" in py[1]


def test_a_relayed_head_keeps_the_speculative_fields():
    """relay_head (the C++ re-encode of the incoming Forward for the next stage) carries
    rollback / drafts / speculate / max_draft on unchanged, with the bytes wire.encode gives
    the Python relay's header."""
    hops = [wire.Hop(endpoint="h1:1", tokens=False), wire.Hop(endpoint="h2:2", tokens=True)]
    h = wire.Forward(model="m", session="s", epoch=3, first_pos=10, n_tokens=4, layer=0,
                     tokens=[1, 2, 3, 4], want="token", relay=hops, reply_to="r",
                     loop=[wire.Hop(endpoint="h0:0"), *hops], steps=9, rollback=2, drafts=3,
                     speculate="ngram", max_draft=6)
    x = np.random.default_rng(1).standard_normal((4, 16), dtype=np.float32)
    for keep in (False, True):
        head, payload = _frame.relay_head(h, x, 12, keep)
        frame = bytes(head) + payload.tobytes()
        nh = msgspec.structs.replace(h, layer=12, relay=hops[1:],
                                     tokens=h.tokens if keep else None)
        assert frame == wire.encode(nh, x)
        back = wire.decode(frame).header
        assert (back.rollback, back.drafts, back.speculate, back.max_draft) == (2, 3, "ngram", 6)
        assert back.layer == 12 and back.relay == hops[1:]


def test_the_wire_fuzzers_corpus_and_mutations_decode_alike():
    """dgr.testing.wirefuzz's corpus (every message, codec and compression; the schema-4
    verify step among them) and 3000 of its mutations: both decoders agree on each."""
    import random

    from dgr.testing import wirefuzz

    assert [check_agree(f, {}) for f in wirefuzz.CORPUS].count("accept-Forward") >= 2
    rng = random.Random(wirefuzz.SEED + 7)
    for _ in range(3000):
        check_agree(wirefuzz.mutate(rng), {})


MEDIA_BASE = {"model": "m", "session": "s", "epoch": 1, "first_pos": 4, "n_tokens": 2,
              "layer": 0, "media": "image", "causal": False,
              "sections": [4, 4, 4, 5, 4, 5, 0, 0]}


def test_a_media_step_round_trips_natively():
    """Forward.media / sections / causal (schema 6): the C++ encoder writes wire.encode's
    bytes, both decoders read them back, and a relayed head keeps them."""
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    h = wire.Forward(**MEDIA_BASE)
    frame = wire.encode(h, a)
    assert _frame.encode_frame(h, a) == frame
    py, c = _both(frame)
    assert py == c and (c.media, c.sections, c.causal) == ("image", MEDIA_BASE["sections"], False)
    relayed = wire.Forward(**{**MEDIA_BASE, "relay": [wire.Hop(endpoint="a:1"),
                                                      wire.Hop(endpoint="b:2")],
                              "reply_to": "r"})
    head, payload = _frame.relay_head(relayed, a, 2, False)
    got = wire.decode(bytes(head) + bytes(payload)).header
    assert (got.layer, got.media, got.sections, got.causal) == (2, "image",
                                                                MEDIA_BASE["sections"], False)
    assert [hop.endpoint for hop in got.relay] == ["b:2"]


@pytest.mark.parametrize("fields,message", [
    ({"media": "video"}, "unknown Forward.media 'video' (known: image, audio)"),
    ({"tokens": [1, 2]}, "Forward.media carries rows (width > 0) and no token ids"),
    ({"media": "", "sections": None}, "Forward.sections and causal=False are a media step's "
                                      "(Forward.media)"),
    ({"sections": [4] * 6}, "Forward.sections has 6 entries but n_tokens is 2 (4 per row)"),
    ({"sections": [3] + [4] * 7}, "Forward.sections[0] is 3 but first_pos is 4"),
    ({"positions": [4, 5]}, "Forward.sections replaces positions: one of them"),
    ({"steps": 2, "reply_to": "r", "loop": [wire.Hop(endpoint="a:1")], "want": "token"},
     "a Forward.media step is one step of prompt rows: no loop, no drafts"),
])
def test_the_media_rules_refuse_alike(fields, message):
    """Each cross-field rule of the schema-6 fields broken: both encoders refuse with
    InvalidArgument and the same message, both decoders with FrameError and that message."""
    h = wire.Forward(**{**MEDIA_BASE, **fields})
    a = np.zeros((2, 4), np.float32)
    for enc in (wire.encode, _frame.encode_frame):
        with pytest.raises(errors.InvalidArgument) as e:
            enc(h, a)
        assert str(e.value) == message
    hb, _ = split(wire.encode(wire.Forward(**MEDIA_BASE), a))
    items = msgspec.msgpack.decode(hb)
    for name, v in fields.items():
        items[FORWARD_ITEM[name]] = (v if name not in ("relay", "loop")
                                     else [[x.endpoint, x.tokens] for x in v])
    py, c = _both(build(msgspec.msgpack.encode(items), a.tobytes()))
    assert py == c and py[0] is FrameError and message in py[1]
