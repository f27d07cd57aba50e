# cython: language_level=3, boundscheck=False, wraparound=False, embedsignature=True
"""Private compiled core of dgr: binds dgr::Engine (cpp/). Users import ``dgr``."""

from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.utility cimport move
from libcpp.vector cimport vector

cimport numpy as cnp
import threading

import numpy as np

from dgr._core.includes.engine cimport (
    DGR_CPU_VARIANT, DGR_LLAMA_COMMIT, DGR_PATCH_STACK_HASH, DGR_VENDOR_KEY,
    CDeviceInfo, CEngine, CEngineConfig,
    CEngineCounters, CMedia, CMediaChunk, CMediaConfig, CMediaInfo, CMediaStep,
    CEngineInfo, CStatus, ArchSupportsLayerRange, BuiltBackends, CpuFeatures, HasLayerRanges, ListDevices,
    MtmdHelperLogits,
)
from dgr import errors as _errors

cnp.import_array()

HAS_LAYER_RANGES = HasLayerRanges()
#: what this binary was compiled against (baked in at build time by setup.py)
BUILD_INFO = {
    "llama_cpp_commit": DGR_LLAMA_COMMIT.decode(),
    "patch_stack_hash": DGR_PATCH_STACK_HASH.decode(),
    "vendor_key": DGR_VENDOR_KEY.decode(),
    "cpu_variant": DGR_CPU_VARIANT.decode(),
    "layer_ranges": HAS_LAYER_RANGES,
}


def devices():
    """The compute devices this build's ggml backends see, the CPU first: one dict each with
    ``name`` (what ``device=`` takes; ``"cpu"`` for the CPU), ``description``, ``type``
    (``cpu``, ``gpu``, ``igpu``, ``accel``), ``backend``, ``device_id``, ``driver`` and
    ``memory_free``/``memory_total`` in bytes."""
    cdef vector[CDeviceInfo] out
    cdef CStatus st
    with nogil:
        st = ListDevices(&out)
    check_status(st)
    res = []
    for i in range(out.size()):
        d = out[i]
        name = d.name.decode("utf-8", "replace")
        res.append({
            "name": "cpu" if d.type.decode() == "cpu" else name,
            "description": d.description.decode("utf-8", "replace"),
            "type": d.type.decode(), "backend": d.backend.decode("utf-8", "replace"),
            "device_id": d.device_id.decode("utf-8", "replace"),
            "driver": d.driver.decode("utf-8", "replace"),
            "memory_free": d.memory_free, "memory_total": d.memory_total,
        })
    return res


def cpu_features():
    """What this build's CPU code was compiled for: ggml's feature names (``AVX2``, ``F16C``,
    ``OPENMP``, ``REPACK``; ``NAME=value`` where the value is not 1). With :data:`BUILD_INFO`'s
    ``cpu_variant`` it names the kernels a CPU stage runs."""
    return [f.decode("utf-8", "replace") for f in CpuFeatures()]


def backends():
    """The ggml backends this binary was built with, by registry name (``CPU``, ``Vulkan``,
    ``CUDA``, ``RPC``, ...)."""
    return [b.decode("utf-8", "replace") for b in BuiltBackends()]


def arch_supports_layer_range(str arch):
    """Whether a model of architecture ``arch`` (its GGUF ``general.architecture``, e.g.
    ``"llama"``) may load a partial layer range.

    The answer is the patched llama.cpp's (``llama_arch_supports_layer_range``: the archs
    whose stage graph a patch adapts); False when this build has no layer ranges. Any
    architecture loads whole.
    """
    return ArchSupportsLayerRange(arch.encode("utf-8"))


cdef int check_status(const CStatus & st) except -1:
    """The one bridge from dgr::Status to the classes of dgr/errors.py."""
    if st.ok():
        return 0
    raise _errors.from_code(st.code, st.message.decode("utf-8", "replace"))


cdef str _what(object a):
    """A short description of ``a`` for an error message."""
    if isinstance(a, np.ndarray):
        layout = "C-contiguous" if a.flags.c_contiguous else "non-contiguous"
        return f"a {layout} {a.dtype} array of shape {list(a.shape)}"
    return f"a {type(a).__name__}"


cdef cnp.ndarray _array(object a, str name, object dtype, int ndim, object error):
    """``a`` itself when it is a C-contiguous numpy array of ``dtype`` with ``ndim``
    dimensions, which the engine may read through a raw pointer; else ``error`` is raised."""
    if (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == ndim
            and a.flags.c_contiguous):
        return <cnp.ndarray> a
    raise error(f"{name} must be a {ndim}-D C-contiguous {np.dtype(dtype).name} array, "
                f"got {_what(a)}")


cdef cnp.ndarray _mask(object want, Py_ssize_t n):
    """A logits mask (bool or uint8, one entry per token) as contiguous uint8."""
    if isinstance(want, np.ndarray) and want.dtype == np.bool_:
        want = want.view(np.uint8)
    a = _array(want, "logits mask", np.uint8, 1, _errors.InvalidArgument)
    if a.shape[0] != n:
        raise _errors.InvalidArgument(
            f"logits mask must have one entry per token ({n}), got shape {want.shape}")
    return a


cdef object _out(object out, Py_ssize_t rows, int32_t width):
    """The output buffer: ``out`` checked (writable C-contiguous float32 ``[>=rows, width]``),
    or a new one."""
    if out is None:
        return np.empty((rows, width), dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32
            or not out.flags.c_contiguous or not out.flags.writeable
            or out.ndim != 2 or out.shape[0] < rows or out.shape[1] != width):
        raise _errors.InvalidArgument(
            f"out must be a writable C-contiguous float32 array of shape "
            f"[>={rows}, {width}], got {_what(out)}")
    return out


cdef class Engine:
    """A share of a GGUF model (layers [a, b)) on the CPU, with sequence slots.

    This is the compiled half; ``dgr.Engine`` is the documented public class.

    ``lock`` (a ``threading.RLock``) is the one lock of the engine: every call into the C++
    engine holds it (the C++ engine keeps none), and a caller that needs several calls to be
    atomic holds it around them (it is re-entrant).
    """

    cdef unique_ptr[CEngine] _e
    cdef readonly int32_t n_vocab
    cdef readonly int32_t n_embd_boundary
    cdef readonly int32_t output_width
    cdef readonly bint is_first
    cdef readonly bint is_last
    cdef readonly bint needs_token_ids
    cdef readonly bint mtp
    cdef readonly int32_t n_slots
    cdef int32_t _n_embd  # the width of an embedding row (``_embed``)
    cdef readonly object lock

    def __cinit__(self, str model_path, int layer_start=0, int layer_end=-1, *,
                  unsigned int n_ctx=1024, unsigned int n_slots=1, int n_threads=1,
                  unsigned int n_ubatch=64, bint flash_attn=True, str type_k="f16",
                  str type_v="f16", bint batch_invariant=False, bint use_mmap=True, bint mtp=False, str device="cpu",
                  unsigned long long device_memory_limit=0, unsigned int state_snapshots=4,
                  unsigned long long kv_budget_mib=0):
        cdef CEngineConfig cfg
        cdef CStatus st
        cdef unique_ptr[CEngine] e
        cfg.model_path = model_path.encode("utf-8")
        cfg.layer_start = layer_start
        cfg.layer_end = layer_end
        cfg.n_ctx = n_ctx
        cfg.n_slots = n_slots
        cfg.n_threads = n_threads
        cfg.n_ubatch = n_ubatch
        cfg.flash_attn = flash_attn
        cfg.batch_invariant = batch_invariant
        cfg.type_k = type_k.encode()
        cfg.type_v = type_v.encode()
        cfg.use_mmap = use_mmap
        cfg.mtp = mtp
        cfg.state_snapshots = state_snapshots
        cfg.device = device.encode("utf-8")
        cfg.device_memory_limit = device_memory_limit
        cfg.kv_budget = kv_budget_mib << 20
        self.lock = threading.RLock()
        with nogil:
            st = CEngine.Load(cfg, &e)
        check_status(st)
        self._e = move(e)
        cdef const CEngineInfo * info = &self._e.get().info()
        self.n_vocab = info.n_vocab
        self.n_embd_boundary = info.n_embd_boundary
        self.output_width = self._e.get().OutputWidth()
        self.is_first = self._e.get().is_first()
        self.is_last = self._e.get().is_last()
        self.needs_token_ids = info.needs_token_ids
        self.mtp = info.mtp
        self.n_slots = info.n_slots
        self._n_embd = info.n_embd

    def _info(self):
        """Engine facts as a dict (memory figures refreshed)."""
        with self.lock:
            check_status(self._e.get().RefreshMemory())
        cdef const CEngineInfo * i = &self._e.get().info()
        return {
            "arch": i.arch.decode(), "desc": i.desc.decode("utf-8", "replace"),
            "n_layer": i.n_layer, "layer_start": i.layer_start, "layer_end": i.layer_end,
            "n_embd": i.n_embd, "n_embd_boundary": i.n_embd_boundary, "n_vocab": i.n_vocab,
            "n_ctx_train": i.n_ctx_train, "n_ctx": i.n_ctx, "n_ctx_alloc": i.n_ctx_alloc,
            "n_ctx_source": i.n_ctx_source.decode("utf-8", "replace"),
            "n_slots": i.n_slots, "n_ubatch": i.n_ubatch, "n_threads": i.n_threads,
            "flash_attn": bool(i.flash_attn), "batch_invariant": bool(i.batch_invariant),
            "type_k": i.type_k.decode(),
            "type_v": i.type_v.decode(), "hash_layer_count": i.hash_layer_count,
            "needs_token_ids": bool(i.needs_token_ids), "n_params": i.n_params,
            "weight_bytes": i.weight_bytes, "kv_bytes": i.kv_bytes,
            "compute_bytes": i.compute_bytes, "token_bos": i.token_bos,
            "token_eos": i.token_eos, "add_bos": bool(i.add_bos), "mtp": bool(i.mtp),
            "n_layer_nextn": i.n_layer_nextn, "rollback_window": i.rollback_window,
            "state_bytes": i.state_bytes, "state_snapshots": i.state_snapshots,
            "n_embd_inp": i.n_embd_inp, "n_pos_per_embd": i.n_pos_per_embd,
            "state_snapshot_bytes": self._e.get().StateSnapshotBytes(),
            # "cpu" for the CPU device, else ggml's device name ("Vulkan0", "CUDA0")
            "device": "cpu" if i.device_type.decode() == "cpu" else i.device.decode(),
            "device_desc": i.device_desc.decode("utf-8", "replace"),
            "device_type": i.device_type.decode(), "backend": i.backend.decode(),
            "device_driver": i.device_driver.decode("utf-8", "replace"),
            "device_memory_free": i.device_memory_free,
            "device_memory_total": i.device_memory_total,
            "device_weight_bytes": i.device_weight_bytes,
            "device_kv_bytes": i.device_kv_bytes,
            "device_compute_bytes": i.device_compute_bytes,
        }

    def _inject_fault(self, str what):
        """Test hook: ``"device_lost"`` makes the engine act as after a lost device (its
        slots gone, every later compute call ``DeviceLost``), so the layers above can be
        tested on any device."""
        with self.lock:
            check_status(self._e.get().InjectFault(what.encode()))

    def tokenize(self, text, bint add_special=True, bint parse_special=False):
        """Token ids of ``text`` (str or bytes) as an int32 array. Reads the vocabulary
        only: it never waits for a forward (no engine lock), as llama-server tokenizes on
        its HTTP threads."""
        cdef string s = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cdef vector[int32_t] out
        cdef CStatus st
        with nogil:
            st = self._e.get().Tokenize(s, add_special, parse_special, &out)
        check_status(st)
        arr = np.empty(out.size(), dtype=np.int32)
        cdef int32_t[::1] view = arr
        if out.size():
            memcpy(&view[0], out.data(), out.size() * sizeof(int32_t))
        return arr

    def detokenize(self, tokens, bint remove_special=False, bint unparse_special=False):
        """Text of ``tokens`` (any int sequence). No engine lock, as ``tokenize``."""
        cdef cnp.ndarray arr = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef string out
        cdef CStatus st
        cdef const int32_t * p = <const int32_t *> cnp.PyArray_DATA(arr)
        cdef size_t n = arr.shape[0]
        with nogil:
            st = self._e.get().Detokenize(p, n, remove_special, unparse_special, &out)
        check_status(st)
        return out.decode("utf-8", "replace")

    def token_pieces(self, int first=0, count=None, bint special=False):
        """The bytes of each token id from ``first`` (``count`` of them, None: to the end of
        the vocabulary) as llama.cpp renders it alone (``llama_token_to_piece``, no leading
        space removed, control tokens empty unless ``special``): what llama-server appends
        to a generation's text per token. A list of bytes; no engine lock."""
        cdef int32_t c = self.n_vocab - first if count is None else count
        cdef string out
        cdef vector[int32_t] ends
        cdef CStatus st
        with nogil:
            st = self._e.get().TokenPieces(first, c, special, &out, &ends)
        check_status(st)
        data = <bytes> out
        res = []
        cdef size_t i
        cdef int32_t start = 0
        for i in range(ends.size()):
            res.append(data[start:ends[i]])
            start = ends[i]
        return res

    def is_eog(self, int token):
        """Whether ``token`` ends a generation (EOS, EOT, ...)."""
        return self._e.get().IsEog(token)

    def next_pos(self, int slot):
        """Position the slot expects next (0 when empty)."""
        cdef int32_t p
        with self.lock:
            p = self._e.get().NextPos(slot)
        if p < 0:
            raise _errors.UnknownSlot(
                f"slot {slot} does not exist; this engine has slots 0..{self.n_slots - 1}")
        return p

    def state_snapshots(self, int slot):
        """The positions at which a recurrent or hybrid stage keeps a snapshot of the slot's
        state (oldest first: the ends of whole ``n_ubatch`` chunks prefilled from position 0,
        the last ``describe()["state_snapshots"]`` of them); ``truncate`` to one restores it.
        Empty on any other memory."""
        with self.lock:
            return list(self._e.get().StateSnapshots(slot))

    @property
    def graphs_reused(self):
        """Forwards that reused llama.cpp's previous graph (no graph build or scheduling: the
        same ubatch shape, sequences and inputs) since load."""
        with self.lock:
            return self._e.get().GraphsReused()

    @property
    def counters(self):
        """What the trunk's forwards cost since load, as a dict: ``forwards`` (forwards
        completed), ``decodes`` (``llama_decode`` calls: more than ``n_ubatch`` tokens
        take several), ``ubatches`` (the ubatches llama.cpp's equal split makes of them: one
        per run of consecutive slots with as many tokens each), ``forward_s`` (wall seconds
        in the engine's forward: checks, gathers, output copies) and ``decode_s`` (of which
        in ``llama_decode``: graph build or reuse, and the compute), ``graphs_reused``. Read
        without the engine's lock (a forward running now may be counted or not yet)."""
        cdef CEngineCounters c = self._e.get().GetCounters()
        return {"forwards": c.forwards, "decodes": c.decodes, "ubatches": c.ubatches,
                "forward_s": c.forward_ns * 1e-9, "decode_s": c.decode_ns * 1e-9,
                "graphs_reused": c.graphs_reused}

    def release(self, int slot):
        """Drop the slot's state; its next forward starts at position 0."""
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().Release(slot)
        check_status(st)

    def copy_slot(self, int src, int dst):
        """Make slot ``dst`` a copy of slot ``src``: its caches bit for bit and its next
        position (a session forked after its prefill, ``n`` choices). ``UnknownSlot`` for a
        slot out of range; ``InvalidArgument`` for ``src == dst``, with MTP and on deepseek4."""
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().CopySlot(src, dst)
        check_status(st)

    def truncate(self, int slot, int pos):
        """Drop the slot's positions from ``pos`` on (rejected drafts); its next forward
        starts at ``pos``. ``pos`` at or past ``next_pos`` changes nothing. On an MTP engine
        the NextN block's cache is truncated too, and its pending hidden row becomes the
        trunk's row at ``pos - 1``.

        Raises
        ------
        dgr.errors.RollbackUnsupported
            A cache of this stage cannot drop that tail; the slot was cleared (re-prefill).
            DeepSeek V4 drops at most ``describe()["rollback_window"]`` positions, and only of
            the slot's last forward (not again before the next forward); a recurrent or hybrid
            model's stage (Mamba, Qwen3.5, Nemotron-H, ...) drops a tail only back to one of
            its state snapshots (``state_snapshots(slot)``; its window is 0).
        dgr.errors.UnknownSlot, dgr.errors.InvalidPosition
            No such slot; ``pos`` is negative.
        """
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().Truncate(slot, pos)
        check_status(st)

    def mtp_draft(self, int slot, int token, int n_max):
        """Greedy draft of up to ``n_max`` tokens by the NextN (MTP) block, as a list of ints.

        ``token`` is the token at ``next_pos(slot)`` (the one sampled from the last logits);
        the NextN block pairs it with the trunk's hidden row at ``next_pos(slot) - 1``, takes
        the argmax (lowest id on ties), and feeds each draft back with its own hidden row.
        Fewer than ``n_max`` only where the slot's context ends (``token`` and the drafts
        must fit as one step). The slot's state is unchanged; the same state gives the same
        drafts.

        Raises
        ------
        dgr.errors.MtpNotSupported
            The engine was loaded without ``mtp``.
        dgr.errors.UnknownSlot, dgr.errors.InvalidToken, dgr.errors.InvalidArgument
            No such slot; ``token`` outside the vocabulary; ``n_max < 0``.
        dgr.errors.InvalidPosition
            The slot holds no positions yet (forward the prompt first).
        """
        cdef vector[int32_t] out
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().MtpDraft(slot, token, n_max, &out)
        check_status(st)
        return [out[i] for i in range(out.size())]

    def _forward(self, int slot, object pos, object tokens, object boundary, object want,
                 object out):
        """Validated-array forward of one slot; see ``dgr.Engine.forward``. A one-slot
        ``_forward_batch`` (the C++ engine's ``Forward`` runs its one forward core)."""
        return self._step(None, slot, pos, tokens, boundary, want, out)

    def _embed(self, int slot, object pos, object tokens, object boundary):
        """Validated-array embedding forward of one slot (the last stage): every row's final
        normed hidden state, float32 ``[n_tokens, n_embd]``; see ``dgr.Engine.embed``."""
        cdef cnp.ndarray p = _array(pos, "positions", np.int32, 1, _errors.InvalidPosition)
        if p.shape[0] > INT32_MAX:
            raise _errors.InvalidPosition(f"{p.shape[0]} positions: at most {INT32_MAX} per step")
        cdef int32_t n = <int32_t> p.shape[0]
        cdef const int32_t * ppos = <const int32_t *> cnp.PyArray_DATA(p)
        cdef const int32_t * ptok = NULL
        cdef const float * pbnd = NULL
        cdef cnp.ndarray a
        if tokens is not None:
            a = _array(tokens, "tokens", np.int32, 1, _errors.InvalidArgument)
            if a.shape[0] != n:
                raise _errors.InvalidPosition(f"{n} positions for {a.shape[0]} tokens")
            ptok = <const int32_t *> cnp.PyArray_DATA(a)
        if boundary is not None:
            a = _array(boundary, "boundary", np.float32, 2, _errors.InvalidBoundary)
            if a.shape[1] != self.n_embd_boundary or a.shape[0] != n:
                raise _errors.InvalidBoundary(
                    f"boundary must have shape [{n}, {self.n_embd_boundary}], "
                    f"got {list(boundary.shape)}")
            pbnd = <const float *> cnp.PyArray_DATA(a)
        cdef cnp.ndarray o = np.empty((n, self._n_embd), dtype=np.float32)
        cdef float * pout = <float *> cnp.PyArray_DATA(o)
        cdef size_t cap = <size_t> o.shape[0] * <size_t> o.shape[1]
        cdef int32_t n_rows = 0
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().Embed(slot, ppos, ptok, pbnd, n, pout, cap, &n_rows)
        check_status(st)
        return o

    def _forward_media(self, int slot, object pos, object rows, bint causal, object want,
                       object out):
        """Validated-array media step of one slot (an image or audio chunk); see
        ``dgr.Engine.forward_media``: ``pos`` int32 ``[n]`` or ``[n_pos_per_embd, n]``
        (section-major), ``rows`` float32 ``[n, width]`` (the first stage's embedding rows,
        ``n_embd_inp`` wide, or the boundary)."""
        cdef const CEngineInfo * info = &self._e.get().info()
        cdef cnp.ndarray r = _array(rows, "rows", np.float32, 2, _errors.InvalidBoundary)
        cdef int32_t width = info.n_embd_inp if self.is_first else self.n_embd_boundary
        if r.shape[1] != width:
            raise _errors.InvalidBoundary(
                f"{'embedding rows' if self.is_first else 'boundary'} must have shape "
                f"[n_rows, {width}], got {list(rows.shape)}")
        if r.shape[0] > INT32_MAX or r.shape[0] < 1:
            raise _errors.InvalidArgument(f"a media step of {r.shape[0]} rows")
        cdef int32_t n = <int32_t> r.shape[0]
        p = np.asarray(pos)
        cdef cnp.ndarray pa = _array(p.reshape(1, -1) if p.ndim == 1 else p, "positions",
                                     np.int32, 2, _errors.InvalidPosition)
        if pa.shape[1] != n:
            raise _errors.InvalidPosition(f"{pa.shape[1]} positions for {n} rows")
        cdef CMediaStep step
        step.rows = <const float *> cnp.PyArray_DATA(r)
        step.pos = <const int32_t *> cnp.PyArray_DATA(pa)
        step.n_sections = <int32_t> pa.shape[0]
        step.causal = causal
        cdef const uint8_t * pwant = NULL
        cdef cnp.ndarray a
        cdef int32_t nrows = 1 if self.is_last else n
        if want is not None:
            a = _mask(want, n)
            pwant = <const uint8_t *> cnp.PyArray_DATA(a)
            nrows = <int32_t> np.count_nonzero(want) if self.is_last else n
        out = _out(out, nrows, self.output_width)
        cdef cnp.ndarray o = <cnp.ndarray> out
        cdef float * pout = <float *> cnp.PyArray_DATA(o)
        cdef size_t cap = <size_t> o.shape[0] * <size_t> o.shape[1]
        cdef int32_t n_rows = 0
        cdef CStatus st
        with self.lock:
            with nogil:
                st = self._e.get().ForwardMedia(slot, step, n, pwant, pout, cap, &n_rows)
        check_status(st)
        return out if o.shape[0] == n_rows else out[:n_rows]

    def _forward_batch(self, object slots, object pos, object tokens, object boundary,
                       object want, object out):
        """Validated-array batched forward; see ``dgr.Engine.forward_batch``."""
        return self._step(slots, 0, pos, tokens, boundary, want, out)

    cdef object _step(self, object slots, int slot, object pos, object tokens, object boundary,
                      object want, object out):
        """The one binding of a forward: ``slots`` (one per token) for a batch, or None for a
        step of ``slot`` alone.

        The C++ engine reads every array through a raw pointer, so each one is checked here,
        before it is called: its type, dtype, C-contiguity, dimensions, one entry or row per
        token, the boundary width (nothing is converted or copied). A mismatch raises the error
        ``dgr.Engine.forward`` raises for the same argument: ``UnknownSlot`` (slots),
        ``InvalidPosition`` (pos), ``InvalidArgument`` (tokens, want, out),
        ``InvalidBoundary`` (boundary). What the values mean (slots in range, positions
        continuing each slot, token ids in the vocabulary, which stage takes what) the C++
        engine checks.
        """
        cdef cnp.ndarray sl
        cdef const int32_t * pslots = NULL
        cdef cnp.ndarray p = _array(pos, "positions", np.int32, 1, _errors.InvalidPosition)
        if p.shape[0] > INT32_MAX:
            raise _errors.InvalidPosition(f"{p.shape[0]} positions: at most {INT32_MAX} per step")
        cdef int32_t n = <int32_t> p.shape[0]
        if slots is not None:
            sl = _array(slots, "slots", np.int32, 1, _errors.UnknownSlot)
            if sl.shape[0] != n:
                raise _errors.InvalidPosition(f"{n} positions for {sl.shape[0]} slots")
            pslots = <const int32_t *> cnp.PyArray_DATA(sl)
        cdef const int32_t * ppos = <const int32_t *> cnp.PyArray_DATA(p)
        cdef const int32_t * ptok = NULL
        cdef const float * pbnd = NULL
        cdef const uint8_t * pwant = NULL
        cdef cnp.ndarray a
        cdef int32_t rows
        if tokens is not None:
            a = _array(tokens, "tokens", np.int32, 1, _errors.InvalidArgument)
            ptok = <const int32_t *> cnp.PyArray_DATA(a)
        if boundary is not None:
            a = _array(boundary, "boundary", np.float32, 2, _errors.InvalidBoundary)
            if a.shape[1] != self.n_embd_boundary:
                raise _errors.InvalidBoundary(
                    f"boundary must have shape [n_tokens, {self.n_embd_boundary}], "
                    f"got {list(boundary.shape)}")
            if tokens is not None and a.shape[0] != len(tokens):
                raise _errors.InvalidBoundary(
                    f"boundary has {a.shape[0]} rows but {len(tokens)} token ids were given")
            pbnd = <const float *> cnp.PyArray_DATA(a)
        if tokens is not None and len(tokens) != n:
            raise _errors.InvalidPosition(f"{n} positions for {len(tokens)} tokens")
        if boundary is not None and len(boundary) != n:
            if slots is None:  # a step's positions are its rows: the positions are wrong
                raise _errors.InvalidPosition(f"{n} positions for {len(boundary)} boundary rows")
            raise _errors.InvalidBoundary(
                f"boundary has {len(boundary)} rows but the batch has {n} tokens")
        if want is not None:
            a = _mask(want, n)
            pwant = <const uint8_t *> cnp.PyArray_DATA(a)
            rows = <int32_t> np.count_nonzero(want) if self.is_last else n
        elif not self.is_last:
            rows = n
        elif slots is None:
            rows = 1
        else:
            rows = <int32_t> np.unique(sl).shape[0]
        out = _out(out, rows, self.output_width)
        cdef cnp.ndarray o = <cnp.ndarray> out
        cdef float * pout = <float *> cnp.PyArray_DATA(o)
        cdef size_t cap = <size_t> o.shape[0] * <size_t> o.shape[1]
        cdef int32_t n_rows = 0
        cdef CStatus st
        with self.lock:
            with nogil:
                if pslots == NULL:
                    st = self._e.get().Forward(slot, ppos, ptok, pbnd, n, pwant, pout, cap, &n_rows)
                else:
                    st = self._e.get().ForwardBatch(pslots, ppos, ptok, pbnd, n, pwant, pout, cap,
                                                    &n_rows)
        check_status(st)
        return out if o.shape[0] == n_rows else out[:n_rows]


include "_media.pxi"
