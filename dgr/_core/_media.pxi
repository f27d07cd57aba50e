# Included by _core.pyx: the projector's binding (cpp/include/dgr/media.h). It lives in the
# same extension module as Engine, whose llama_model it opens libmtmd on (each extension
# module keeps its own copy of the static llama.cpp).

#: MediaChunk.kind's names (mtmd_input_chunk_type)
MEDIA_KINDS = ("text", "image", "audio")


cdef class Media:
    """A model's projector (an ``mmproj`` GGUF) through the pinned tree's libmtmd, opened on
    a first-stage (or whole-model) ``Engine``. ``tokenize`` cuts a prompt with media markers
    into chunks, ``encode`` gives a media chunk's embedding rows, ``positions`` its positions:
    what ``Engine.forward_media`` takes on every stage. Calls are serialized by the engine's
    lock (libmtmd's context is not thread-safe)."""

    cdef unique_ptr[CMedia] _m
    cdef readonly object engine
    cdef readonly bint vision
    cdef readonly bint audio
    cdef readonly bint mrope
    cdef readonly int audio_sample_rate
    cdef readonly int n_embd_inp
    cdef readonly str marker

    def __cinit__(self, Engine engine, str mmproj_path, *, int n_threads=1,
                  bint flash_attn=True, bint warmup=False):
        cdef CMediaConfig cfg
        cfg.mmproj_path = mmproj_path.encode("utf-8")
        cfg.n_threads = n_threads
        cfg.flash_attn = flash_attn
        cfg.warmup = warmup
        cdef CStatus st
        cdef unique_ptr[CMedia] m
        with engine.lock:
            with nogil:
                st = CMedia.Open(engine._e.get()[0], cfg, &m)
        check_status(st)
        self._m = move(m)
        self.engine = engine
        cdef const CMediaInfo * i = &self._m.get().info()
        self.vision, self.audio, self.mrope = i.vision, i.audio, i.mrope
        self.audio_sample_rate = i.audio_sample_rate
        self.n_embd_inp = i.n_embd_inp
        self.marker = i.marker.decode("utf-8", "replace")

    def tokenize(self, str prompt, media=(), bint add_special=True, bint parse_special=True,
                 uint64_t max_pixels=0):
        """``prompt``'s chunks, one ``marker`` per item of ``media`` (each a file's bytes: an
        image stb_image decodes, or wav/mp3/flac audio): a list of dicts with ``kind``
        ("text", "image", "audio"), ``tokens`` (a text chunk's ids), ``n_rows`` (the rows it
        takes), ``n_pos`` (the positions it advances), ``id`` (a media chunk's SHA-256) and
        ``non_causal``. Kept until the next call, for ``encode`` and ``positions``.
        ``max_pixels``: an image whose header says it has more (width x height) is refused
        before it is decoded (``InvalidArgument``; 0: no cap)."""
        cdef vector[string] files
        for m in media:
            files.push_back(bytes(m))
        cdef string p = prompt.encode("utf-8")
        cdef vector[CMediaChunk] out
        cdef CStatus st
        with self.engine.lock:
            with nogil:
                st = self._m.get().Tokenize(p, files, add_special, parse_special, &out, max_pixels)
        check_status(st)
        return [{"kind": MEDIA_KINDS[c.kind] if 0 <= c.kind < 3 else str(c.kind),
                 "tokens": [c.tokens[k] for k in range(c.tokens.size())],
                 "n_rows": c.n_rows, "n_pos": c.n_pos, "id": c.id.decode(),
                 "non_causal": bool(c.non_causal)} for c in out]

    def encode(self, size_t i):
        """Media chunk ``i``'s embedding rows (of the last ``tokenize``): float32 ``[n_rows,
        n_embd_inp]``."""
        cdef vector[float] rows
        cdef CStatus st
        with self.engine.lock:
            with nogil:
                st = self._m.get().Encode(i, &rows)
        check_status(st)
        a = np.empty(rows.size(), dtype=np.float32)
        cdef float[::1] v = a
        if rows.size():
            memcpy(&v[0], rows.data(), rows.size() * sizeof(float))
        return a.reshape(-1, self.n_embd_inp)

    def positions(self, size_t i, int pos0):
        """Chunk ``i``'s positions from ``pos0``: int32 ``[n_rows]``, or ``[4, n_rows]`` on an
        M-RoPE model (mtmd's t, y, x, z: section-major, as ``forward_media`` takes them)."""
        cdef vector[int32_t] pos
        cdef CStatus st
        with self.engine.lock:
            st = self._m.get().Positions(i, pos0, &pos)
        check_status(st)
        a = np.array([pos[k] for k in range(pos.size())], dtype=np.int32)
        return a.reshape(4, -1) if self.mrope else a


def mtmd_helper_logits(str model_path, str mmproj_path, str prompt, media=(), *,
                       unsigned int n_ctx=1024, int n_threads=1, unsigned int n_ubatch=64,
                       bint flash_attn=True, str type_k="f16", str type_v="f16",
                       bint add_special=True, bint parse_special=True):
    """llama.cpp's own path for parity: the whole model in a plain llama_context with these
    settings, ``prompt``'s chunks evaluated by ``mtmd_helper_eval_chunks``; the last row's
    logits (float32 ``[n_vocab]``)."""
    cdef CEngineConfig cfg
    cfg.model_path = model_path.encode("utf-8")
    cfg.n_ctx = n_ctx
    cfg.n_threads = n_threads
    cfg.n_ubatch = n_ubatch
    cfg.flash_attn = flash_attn
    cfg.type_k = type_k.encode()
    cfg.type_v = type_v.encode()
    cfg.device = b"cpu"
    cdef CMediaConfig mc
    mc.mmproj_path = mmproj_path.encode("utf-8")
    mc.n_threads = n_threads
    mc.flash_attn = flash_attn
    mc.warmup = False
    cdef vector[string] files
    for m in media:
        files.push_back(bytes(m))
    cdef string p = prompt.encode("utf-8")
    cdef vector[float] logits
    cdef CStatus st
    with nogil:
        st = MtmdHelperLogits(cfg, mc, p, files, add_special, parse_special, &logits)
    check_status(st)
    a = np.empty(logits.size(), dtype=np.float32)
    cdef float[::1] v = a
    if logits.size():
        memcpy(&v[0], logits.data(), logits.size() * sizeof(float))
    return a
