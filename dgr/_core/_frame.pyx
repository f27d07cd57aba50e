# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""Private: the C++ wire frame decoder and encoder (cpp/src/frame.cpp) and the data plane's
frame I/O (cpp/src/frame_io.cpp) for Python.

``decode_frame`` agrees with ``dgr.protocol.wire.decode`` on every frame (accept or reject,
and the error class), ``encode_frame`` gives ``wire.encode``'s bytes (raw codec, no
compression): ``tests/unit/test_frame_native.py`` cross-checks both by fuzzing. Frames with
another codec or zstd raise ``FrameNotNative`` once everything up to the payload checksum is
checked: decode those with ``wire.decode``.

The worker's data plane (``dgr.worker.frames``) uses ``recv_frame``/``send_frame`` (the
socket I/O without the GIL), ``decode`` (``wire.decode``'s ``Frame``, built here) and
``encode_head``/``relay_head`` (a frame's bytes up to its payload, sent with the payload
array itself as a second piece of one gather write: the engine's output is never copied into
a frame).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libcpp.string_view cimport string_view
from libcpp.vector cimport vector
from time import perf_counter

cimport numpy as cnp
import numpy as np

from dgr._core.includes.engine cimport CStatus
from dgr._core.includes.frame cimport (
    CDecodeLimits, CEncodedFrame, CErrorReply, CForward, CFrameView, CHop, CResult, CSampling,
    decode_frame as c_decode,
    encode_forward, encode_result, kErrorReply, kForward, kIoEof, kIoNeedBuffer,
    kIoTimeout, kIoTooLarge, kIoTruncated, kMaxHeader, kMaxPayload, kResult,
    length_prefix, readable as c_readable, recv_exact as c_recv_exact,
    recv_frame as c_recv_frame, send_frame as c_send_frame, send_iov,
)
from posix.uio cimport iovec
from dgr import errors as _errors
from dgr.protocol import wire as _wire

cnp.import_array()

MAX_PAYLOAD = kMaxPayload
MAX_HEADER = kMaxHeader
_F32 = np.dtype("<f4")


cdef int _check(const CStatus & st) except -1:
    if st.ok():
        return 0
    raise _errors.from_code(st.code, st.message.decode("utf-8", "replace"))


cdef inline str _s(string_view v):
    return PyUnicode_DecodeUTF8(v.data(), <Py_ssize_t> v.size(), NULL)


cdef list _ints(const vector[int32_t] & v):
    cdef size_t i
    return [v[i] for i in range(v.size())]


cdef list _hops(const vector[CHop] & v):
    cdef size_t i
    return [{"endpoint": _s(v[i].endpoint), "tokens": v[i].tokens} for i in range(v.size())]


cdef dict _forward(const CForward & h):
    cdef CSampling s = h.sampling
    return {
        "type": "Forward", "schema": h.schema, "model": _s(h.model), "session": _s(h.session),
        "epoch": h.epoch, "first_pos": h.first_pos, "n_tokens": h.n_tokens, "layer": h.layer,
        "width": h.width, "_reserved": h.reserved, "dtype": _s(h.dtype), "codec": _s(h.codec),
        "compression": _s(h.compression), "payload_len": h.payload_len, "checksum": h.checksum,
        "positions": _ints(h.positions) if h.has_positions else None,
        "tokens": _ints(h.tokens) if h.has_tokens else None,
        "want": _s(h.want), "rows": _ints(h.rows) if h.has_rows else None,
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                     "seed": s.seed, "greedy": s.greedy, "min_p": s.min_p,
                     "bias_ids": tuple(s.bias_ids), "bias": tuple(s.bias),
                     "penalty_last_n": s.penalty_last_n, "repeat_penalty": s.repeat_penalty,
                     "frequency_penalty": s.frequency_penalty,
                     "presence_penalty": s.presence_penalty, "grammar": _s(s.grammar),
                     "grammar_id": s.grammar_id, "grammar_from": s.grammar_from}
        if h.has_sampling else None,
        "relay": _hops(h.relay) if h.has_relay else None, "reply_to": _s(h.reply_to),
        "loop": _hops(h.loop) if h.has_loop else None, "steps": h.steps,
        "stop_tokens": _ints(h.stop_tokens) if h.has_stop_tokens else None,
        "solo": h.solo, "rollback": h.rollback, "drafts": h.drafts,
        "speculate": _s(h.speculate), "max_draft": h.max_draft, "media": _s(h.media),
        "sections": _ints(h.sections) if h.has_sections else None, "causal": h.causal,
    }


cdef dict _result(const CResult & h):
    return {
        "type": "Result", "schema": h.schema, "session": _s(h.session), "epoch": h.epoch,
        "first_pos": h.first_pos, "n_tokens": h.n_tokens, "kind": _s(h.kind), "layer": h.layer,
        "rows": h.rows, "cols": h.cols, "_reserved": h.reserved, "dtype": _s(h.dtype),
        "codec": _s(h.codec), "compression": _s(h.compression),
        "payload_len": h.payload_len, "checksum": h.checksum,
        "tokens": _ints(h.tokens) if h.has_tokens else None, "drafted": h.drafted,
    }


cdef dict _fields(CFrameView * v):
    cdef CErrorReply * e
    if v.tag == kForward:
        return _forward(v.forward)
    if v.tag == kResult:
        return _result(v.result)
    if v.tag == kErrorReply:
        e = &v.error
        return {"type": "ErrorReply", "schema": e.schema, "code": e.code,
                "message": _s(e.message), "session": _s(e.session), "epoch": e.epoch,
                "retry_after": e.retry_after if e.has_retry_after else None}
    return {"type": "Hello", "schema": v.hello.schema, "route": _s(v.hello.route)}


cdef object _decode_into(object buf, uint64_t max_payload, uint64_t max_header,
                         CFrameView * v):
    """Validate and decode ``buf`` into ``v`` (raising as ``wire.decode``); returns the
    boundary as a read-only float32 view over ``buf`` (no copy), or None. ``v``'s strings
    point into ``buf``: the caller builds its Python objects from them while it holds
    ``buf``."""
    cdef Py_buffer view
    cdef CDecodeLimits limits
    cdef CStatus st
    cdef cnp.npy_intp dims[2]
    limits.max_payload = max_payload
    limits.max_header = max_header
    try:
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    except Exception as e:  # as wire.decode: not a C-contiguous bytes-like object
        raise _errors.FrameError(f"frame must be a C-contiguous bytes-like object: {e}") from None
    try:
        st = c_decode(<const uint8_t *> view.buf, <size_t> view.len, limits, v)
        _check(st)
        if v.array == NULL:
            return None
        dims[0] = v.rows
        dims[1] = v.cols
        arr = cnp.PyArray_SimpleNewFromData(2, dims, cnp.NPY_FLOAT32, <void *> v.array)
        # The base keeps the memory alive (a memoryview holds a buffer export: a bytearray
        # cannot be resized under the array); the view is read-only like wire.decode's.
        base = buf if type(buf) is bytes else memoryview(buf)
        Py_INCREF(base)
        cnp.PyArray_SetBaseObject(arr, base)
        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
        return arr
    finally:
        PyBuffer_Release(&view)


def decode_frame(object buf, *, uint64_t max_payload=kMaxPayload, uint64_t max_header=kMaxHeader):
    """Validate and decode one frame in C++ (the checks and error classes of ``wire.decode``).

    Returns
    -------
    tuple
        ``(fields, array)``: ``fields`` a dict of the header's fields by their ``wire`` names
        (``"type"``: the message's class name; ``sampling`` and each hop are dicts), ``array``
        the float32 ``[rows, cols]`` boundary as a read-only view over ``buf`` (no copy), or
        None.

    Raises
    ------
    FrameError
        And its subclasses, as ``wire.decode``; ``FrameNotNative`` for a valid-so-far frame
        with a codec other than raw or with zstd compression (use ``wire.decode``).
    """
    cdef CFrameView v
    arr = _decode_into(buf, max_payload, max_header, &v)
    return _fields(&v), arr


def _decode_loop(object buf, int n):
    """Seconds for ``n`` C++ decodes of ``buf`` (no Python objects built): for benches/."""
    cdef Py_buffer view
    cdef CFrameView v
    cdef CDecodeLimits limits
    cdef CStatus st
    cdef int i
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        t0 = perf_counter()
        with nogil:
            for i in range(n):
                st = c_decode(<const uint8_t *> view.buf, <size_t> view.len, limits, &v)
        t1 = perf_counter()
        _check(st)
        return t1 - t0
    finally:
        PyBuffer_Release(&view)


cdef inline string_view _sv(bytes b):
    return string_view(PyBytes_AS_STRING(b), len(b))


cdef bint _list(object src, vector[int32_t] * out) except -1:
    out.clear()
    if src is None:
        return False
    for x in src:
        out.push_back(x)
    return True


cdef bint _hop_list(object src, vector[CHop] * out, list keep) except -1:
    cdef CHop hop
    out.clear()
    if src is None:
        return False
    for h in src:
        b = h.endpoint.encode("utf-8")
        keep.append(b)
        hop.endpoint = _sv(b)
        hop.tokens = h.tokens
        out.push_back(hop)
    return True


cdef object _fill(object header, CForward * f, CResult * r, list keep):
    """Copy ``header``'s fields into ``f`` (Forward) or ``r`` (Result); ``keep`` holds the
    UTF-8 bytes their string views point into. Returns the array to check, or raises."""
    name = type(header).__name__
    if name != "Forward" and name != "Result":
        raise _errors.InvalidArgument(f"encode_frame encodes a Forward or a Result, not {name}")
    try:
        if name == "Forward":
            keep += [header.model.encode("utf-8"), header.session.encode("utf-8"),
                     header.want.encode("utf-8"), header.reply_to.encode("utf-8"),
                     header.speculate.encode("utf-8"), header.media.encode("utf-8")]
            f.schema = header.schema
            f.model = _sv(keep[0])
            f.session = _sv(keep[1])
            f.epoch = header.epoch
            f.first_pos = header.first_pos
            f.n_tokens = header.n_tokens
            f.layer = header.layer
            f.width = header.width
            f.reserved = header._reserved
            f.has_positions = _list(header.positions, &f.positions)
            f.has_tokens = _list(header.tokens, &f.tokens)
            f.want = _sv(keep[2])
            f.has_rows = _list(header.rows, &f.rows)
            s = header.sampling
            f.has_sampling = s is not None
            if s is not None:
                f.sampling.temperature = s.temperature
                f.sampling.top_k = s.top_k
                f.sampling.top_p = s.top_p
                f.sampling.seed = s.seed
                f.sampling.greedy = s.greedy
                f.sampling.min_p = s.min_p
                f.sampling.bias_ids = s.bias_ids
                f.sampling.bias = s.bias
                f.sampling.penalty_last_n = s.penalty_last_n
                f.sampling.repeat_penalty = s.repeat_penalty
                f.sampling.frequency_penalty = s.frequency_penalty
                f.sampling.presence_penalty = s.presence_penalty
                grammar = s.grammar.encode("utf-8")
                keep.append(grammar)  # (no negative index: wraparound is off here)
                f.sampling.grammar = _sv(grammar)
                f.sampling.grammar_id = s.grammar_id
                f.sampling.grammar_from = s.grammar_from
            f.has_relay = _hop_list(header.relay, &f.relay, keep)
            f.reply_to = _sv(keep[3])
            f.has_loop = _hop_list(header.loop, &f.loop, keep)
            f.steps = header.steps
            f.has_stop_tokens = _list(header.stop_tokens, &f.stop_tokens)
            f.solo = header.solo
            f.rollback = header.rollback
            f.drafts = header.drafts
            f.speculate = _sv(keep[4])
            f.max_draft = header.max_draft
            f.media = _sv(keep[5])
            f.has_sections = _list(header.sections, &f.sections)
            f.causal = header.causal
        else:
            keep += [header.session.encode("utf-8"), header.kind.encode("utf-8")]
            r.schema = header.schema
            r.session = _sv(keep[0])
            r.epoch = header.epoch
            r.first_pos = header.first_pos
            r.n_tokens = header.n_tokens
            r.kind = _sv(keep[1])
            r.layer = header.layer
            r.rows = header.rows
            r.cols = header.cols
            r.reserved = header._reserved
            r.has_tokens = _list(header.tokens, &r.tokens)
            r.drafted = header.drafted
    except OverflowError as e:
        raise _errors.InvalidArgument(f"cannot encode {name}: {e}") from None
    return name == "Forward"


cdef object _checked(object array):
    """``array`` as wire.encode takes it: a 2-D C-contiguous little-endian float32 array."""
    if array is None:
        return None
    if type(array) is not np.ndarray:
        raise _errors.InvalidBoundary(f"array must be a numpy.ndarray, got {type(array).__name__}")
    dt = array.dtype
    if dt != _F32:
        if dt.kind != "f" or dt.itemsize != 4:
            raise _errors.InvalidBoundary(f"array dtype must be float32, got {dt}")
        array = array.astype(_F32)
    if array.ndim != 2:
        raise _errors.InvalidBoundary(f"array must be 2-D [rows, width], got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise _errors.InvalidBoundary("array must be C-contiguous for the raw codec")
    return array


cdef object _encode(CForward * f, CResult * r, bint forward, object array,
                    CEncodedFrame * out):
    """Encode the filled header (``f`` or ``r``) with ``array`` into ``out``; returns the
    array as checked (``_checked``), which ``out`` points into."""
    cdef CStatus st
    cdef const float * data = NULL
    cdef int64_t rows = 0, cols = 0
    array = _checked(array)
    if array is not None:
        rows, cols = array.shape
        data = <const float *> cnp.PyArray_DATA(<cnp.ndarray> array)
    if forward:
        st = encode_forward(f[0], data, rows, cols, out)
    else:
        st = encode_result(r[0], data, rows, cols, out)
    _check(st)
    return array


def encode_frame(object header, object array=None):
    """``wire.encode(header, array)`` (raw codec, no compression) in C++: the same bytes.

    ``header`` is a ``wire.Forward`` or ``wire.Result``; ``array`` a float32 ``[rows, cols]``
    C-contiguous array or None. Raises ``InvalidBoundary``/``InvalidArgument`` as
    ``wire.encode`` does.
    """
    cdef CForward f
    cdef CResult r
    cdef CEncodedFrame out
    cdef list keep = []
    forward = _fill(header, &f, &r, keep)
    array = _encode(&f, &r, forward, array, &out)  # kept: out points into it until copied
    frame = PyBytes_FromStringAndSize(NULL, <Py_ssize_t> out.size())
    out.copy_to(<uint8_t *> PyBytes_AS_STRING(frame))
    return frame


def _encode_loop(object header, object array, int n):
    """Seconds for ``n`` C++ encodes of ``header`` and ``array`` into one reused frame (the
    header's fields read from Python once): for benches/."""
    cdef CForward f
    cdef CResult r
    cdef CEncodedFrame out
    cdef CStatus st
    cdef const float * data = NULL
    cdef int64_t rows = 0, cols = 0
    cdef list keep = []
    cdef int i
    cdef bint forward = _fill(header, &f, &r, keep)
    array = _checked(array)
    if array is not None:
        rows, cols = array.shape
        data = <const float *> cnp.PyArray_DATA(<cnp.ndarray> array)
    cdef vector[uint8_t] buf
    t0 = perf_counter()
    with nogil:
        for i in range(n):
            if forward:
                st = encode_forward(f, data, rows, cols, &out)
            else:
                st = encode_result(r, data, rows, cols, &out)
            buf.resize(out.size())
            out.copy_to(buf.data())
    t1 = perf_counter()
    _check(st)
    return t1 - t0



# --- the data plane's per-frame work ----------------------------------------------------


cdef int _io(int rc, double timeout=-1.0) except -2:
    """0 or kIoEof as they are; raise for the other outcomes of frame_io."""
    if rc == 0 or rc == kIoEof:
        return rc
    if rc == kIoTruncated:
        raise ConnectionError("connection closed inside a frame")
    if rc == kIoTimeout:
        raise _errors.FrameTruncated(f"frame not completed within {timeout:g} s of its first "
                                     "byte: the connection is closed")
    if rc > 0:
        import os
        raise OSError(rc, os.strerror(rc))
    raise ConnectionError(f"frame I/O failed ({rc})")


cdef int64_t _ms(double timeout):
    return -1 if timeout < 0 else <int64_t> (timeout * 1000.0 + 0.5)


def recv_frame(int fd, object buf, size_t max_frame, double timeout=-1.0, double spin=0.0):
    """Read the next length-prefixed frame from socket ``fd`` into ``buf`` (a writable
    buffer), without the GIL. The wait for the frame's first byte is unbounded; with
    ``timeout`` >= 0 (seconds) the rest must arrive within that time of it. With ``spin``
    > 0 (seconds), the wait polls the socket without sleeping for that long before it
    blocks (busy-polling).

    Returns
    -------
    int
        The frame's length: read into ``buf[:n]`` when it fits; when ``n > len(buf)``
        nothing of it is read yet (read it with ``recv_exact`` into a buffer that large).
        -1 at a clean end of stream.

    Raises
    ------
    dgr.errors.FrameTooLarge
        The prefix claims more than ``max_frame`` bytes (the stream is unusable).
    dgr.errors.FrameTruncated
        The frame did not arrive whole within ``timeout`` (the stream is unusable).
    ConnectionError, OSError
        The connection broke (closed inside a frame, or the errno of the failed call).
    """
    cdef Py_buffer view
    cdef size_t size = 0
    cdef int rc
    cdef int64_t ms = _ms(timeout)
    cdef int64_t spin_us = <int64_t> (spin * 1e6) if spin > 0 else 0
    if fd < 0:
        raise OSError(9, "the socket is closed")
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        with nogil:
            rc = c_recv_frame(fd, <uint8_t *> view.buf, <size_t> view.len, max_frame, ms,
                              &size, spin_us)
    finally:
        PyBuffer_Release(&view)
    if rc == kIoNeedBuffer:
        return <Py_ssize_t> size
    if rc == kIoTooLarge:
        raise _errors.FrameTooLarge(f"frame of {size} bytes exceeds the data plane's "
                                    f"{max_frame}")
    if _io(rc, timeout) == kIoEof:
        return -1
    return <Py_ssize_t> size


def recv_exact(int fd, object buf, double timeout=-1.0):
    """Read exactly ``len(buf)`` bytes from socket ``fd`` into ``buf``, without the GIL,
    within ``timeout`` seconds (< 0: unbounded).

    Raises ``ConnectionError`` (closed before the end), ``FrameTruncated`` (not in time) or
    ``OSError``."""
    cdef Py_buffer view
    cdef int rc
    cdef int64_t ms = _ms(timeout)
    if fd < 0:
        raise OSError(9, "the socket is closed")
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        with nogil:
            rc = c_recv_exact(fd, <uint8_t *> view.buf, <size_t> view.len, ms)
    finally:
        PyBuffer_Release(&view)
    if _io(rc, timeout) == kIoEof:
        raise ConnectionError("connection closed inside a frame")


def send_frame(int fd, object head, object payload=None):
    """Send one frame, ``head`` then ``payload`` (bytes-like, C-contiguous; None: none),
    after their length prefix, as one gather write without the GIL (partial writes
    finished). Not locked: the caller keeps frames of several threads apart.

    Raises ``OSError`` (the errno of the failed call; EPIPE for a closed peer)."""
    cdef Py_buffer h, p
    cdef int rc
    cdef bint has_p = payload is not None
    if fd < 0:
        raise OSError(9, "the socket is closed")
    PyObject_GetBuffer(head, &h, PyBUF_SIMPLE)
    try:
        if has_p:
            PyObject_GetBuffer(payload, &p, PyBUF_SIMPLE)
        try:
            with nogil:
                rc = c_send_frame(fd, <const uint8_t *> h.buf, <size_t> h.len,
                                  <const uint8_t *> p.buf if has_p else NULL,
                                  <size_t> p.len if has_p else 0)
        finally:
            if has_p:
                PyBuffer_Release(&p)
    finally:
        PyBuffer_Release(&h)
    _io(rc)


def send_frames(int fd, list frames):
    """Send several frames, each ``(head, payload)`` as ``send_frame`` takes them, in order as
    one stream of gather writes without the GIL (one ``sendmsg`` for up to 341 frames).

    Raises ``OSError`` (the errno of the failed call) with ``sent``, the bytes that went out
    before it (0: none of the frames did)."""
    cdef Py_ssize_t n = len(frames), i, k = 0
    cdef vector[Py_buffer] views
    cdef vector[iovec] iov
    cdef vector[uint8_t] lens
    cdef size_t sent = 0, size
    cdef int rc = 0
    cdef Py_buffer * b
    if fd < 0:
        raise OSError(9, "the socket is closed")
    views.resize(2 * n)
    iov.resize(3 * n)
    lens.resize(4 * n)
    try:
        for i in range(n):
            head, payload = frames[i]
            PyObject_GetBuffer(head, &views[k], PyBUF_SIMPLE)
            k += 1
            size = <size_t> views[k - 1].len
            iov[3 * i + 1].iov_base = views[k - 1].buf
            iov[3 * i + 1].iov_len = <size_t> views[k - 1].len
            iov[3 * i + 2].iov_base = NULL
            iov[3 * i + 2].iov_len = 0
            if payload is not None:
                PyObject_GetBuffer(payload, &views[k], PyBUF_SIMPLE)
                k += 1
                size += <size_t> views[k - 1].len
                iov[3 * i + 2].iov_base = views[k - 1].buf
                iov[3 * i + 2].iov_len = <size_t> views[k - 1].len
            length_prefix(size, &lens[4 * i])
            iov[3 * i].iov_base = &lens[4 * i]
            iov[3 * i].iov_len = 4
        with nogil:
            rc = send_iov(fd, iov.data(), <int> (3 * n), &sent)
    finally:
        for i in range(k):
            PyBuffer_Release(&views[i])
    if rc:
        import os
        e = OSError(rc, os.strerror(rc))
        e.sent = sent
        raise e


def readable(int fd):
    """Whether bytes wait to be read on ``fd`` (a poll that does not wait)."""
    return fd >= 0 and c_readable(fd)


cdef list _ints_or(bint has, const vector[int32_t] & v):
    return _ints(v) if has else None


cdef list _hop_objs(const vector[CHop] & v):
    cdef size_t i
    Hop = _wire.Hop
    return [Hop(endpoint=_s(v[i].endpoint), tokens=v[i].tokens) for i in range(v.size())]


cdef object _message(CFrameView * v):
    """The ``wire`` header struct of a decoded frame (the same value ``wire.decode`` gives)."""
    cdef CForward * f
    cdef CResult * r
    cdef CErrorReply * e
    cdef CSampling s
    if v.tag == kForward:
        f = &v.forward
        s = f.sampling
        return _wire.Forward(
            schema=f.schema, model=_s(f.model), session=_s(f.session), epoch=f.epoch,
            first_pos=f.first_pos, n_tokens=f.n_tokens, layer=f.layer, width=f.width,
            _reserved=f.reserved, dtype=_s(f.dtype), codec=_s(f.codec),
            compression=_s(f.compression), payload_len=f.payload_len, checksum=f.checksum,
            positions=_ints_or(f.has_positions, f.positions),
            tokens=_ints_or(f.has_tokens, f.tokens), want=_s(f.want),
            rows=_ints_or(f.has_rows, f.rows),
            sampling=_wire.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                    seed=s.seed, greedy=s.greedy, min_p=s.min_p,
                                    bias_ids=tuple(s.bias_ids), bias=tuple(s.bias),
                                    penalty_last_n=s.penalty_last_n,
                                    repeat_penalty=s.repeat_penalty,
                                    frequency_penalty=s.frequency_penalty,
                                    presence_penalty=s.presence_penalty,
                                    grammar=_s(s.grammar), grammar_id=s.grammar_id,
                                    grammar_from=s.grammar_from)
            if f.has_sampling else None,
            relay=_hop_objs(f.relay) if f.has_relay else None, reply_to=_s(f.reply_to),
            loop=_hop_objs(f.loop) if f.has_loop else None, steps=f.steps,
            stop_tokens=_ints_or(f.has_stop_tokens, f.stop_tokens), solo=f.solo,
            rollback=f.rollback, drafts=f.drafts, speculate=_s(f.speculate),
            max_draft=f.max_draft, media=_s(f.media),
            sections=_ints_or(f.has_sections, f.sections), causal=f.causal)
    if v.tag == kResult:
        r = &v.result
        return _wire.Result(
            schema=r.schema, session=_s(r.session), epoch=r.epoch, first_pos=r.first_pos,
            n_tokens=r.n_tokens, kind=_s(r.kind), layer=r.layer, rows=r.rows, cols=r.cols,
            _reserved=r.reserved, dtype=_s(r.dtype), codec=_s(r.codec),
            compression=_s(r.compression), payload_len=r.payload_len, checksum=r.checksum,
            tokens=_ints_or(r.has_tokens, r.tokens), drafted=r.drafted)
    if v.tag == kErrorReply:
        e = &v.error
        return _wire.ErrorReply(schema=e.schema, code=e.code, message=_s(e.message),
                                session=_s(e.session), epoch=e.epoch,
                                retry_after=e.retry_after if e.has_retry_after else None)
    return _wire.Hello(schema=v.hello.schema, route=_s(v.hello.route))


def decode(object buf, *, uint64_t max_payload=kMaxPayload, uint64_t max_header=kMaxHeader):
    """``wire.decode(buf, ...)`` in C++: the same ``wire.Frame`` (equal header, the boundary
    a read-only view over ``buf``), the same checks and error classes.

    Raises
    ------
    FrameError
        And its subclasses, as ``wire.decode``; ``FrameNotNative`` for a valid-so-far frame
        with a codec other than raw or with zstd (decode it with ``wire.decode``).
    """
    cdef CFrameView v
    arr = _decode_into(buf, max_payload, max_header, &v)
    return _wire.Frame(_message(&v), arr)


cdef bytes _head_of(CEncodedFrame * out):
    return PyBytes_FromStringAndSize(out.head.data(), <Py_ssize_t> out.head.size())


def encode_head(object header, object array=None):
    """The frame ``encode_frame(header, array)`` would give, as two pieces: ``(head,
    payload)``, ``head`` its bytes up to the payload (prefix, header, padding) and
    ``payload`` the array itself (float32 C-contiguous, or None): ``head + payload``'s bytes
    are the frame. For a gather write (``send_frame``): the array is not copied."""
    cdef CForward f
    cdef CResult r
    cdef list keep = []
    cdef CEncodedFrame out
    forward = _fill(header, &f, &r, keep)
    array = _encode(&f, &r, forward, array, &out)
    return _head_of(&out), array


def relay_head(object header, object array, int32_t layer, bint keep_tokens):
    """``encode_head`` of the ``Forward`` a stage relays on (``dgr.worker.forwarder``): ``header``
    with ``layer`` set, its first ``relay`` hop dropped (the stage it goes to) and its token
    ids kept only when ``keep_tokens`` (that stage routes by token id), and ``array`` the
    boundary; every other field (the decode loop's, the speculative ``rollback``, ``drafts``,
    ``speculate``, ``max_draft``) as it came. Without building the new header in Python."""
    cdef CForward f
    cdef CResult r
    cdef CEncodedFrame out
    cdef list keep = []
    if type(header) is not _wire.Forward:
        raise _errors.InvalidArgument(f"relay_head relays a Forward, not {type(header).__name__}")
    _fill(header, &f, &r, keep)
    f.layer = layer
    if not f.has_relay or f.relay.empty():
        raise _errors.RouteError("relay_head: Forward.relay names no next stage")
    f.relay.erase(f.relay.begin())
    if not keep_tokens:
        f.has_tokens = False
        f.tokens.clear()
    array = _encode(&f, &r, True, array, &out)
    return _head_of(&out), array
