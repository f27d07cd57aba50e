# Declarations of cpp/include/dgr/*.h: all that Cython sees of the engine.
#
# The engine turns every C++ exception into a dgr::Status itself (cpp/src/engine.cpp); the
# methods that can meet one (llama.cpp calls, allocations) are still declared `except +`, so
# that one which escaped anyway becomes a Python exception (MemoryError, RuntimeError, ...)
# instead of std::terminate. The rest are noexcept in C++.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector


cdef extern from "dgr/status.h" namespace "dgr" nogil:
    cdef cppclass CStatus "dgr::Status":
        int code
        string message
        bool ok()


cdef extern from "dgr/engine.h" namespace "dgr" nogil:
    cdef cppclass CEngineConfig "dgr::EngineConfig":
        string model_path
        int32_t layer_start
        int32_t layer_end
        uint32_t n_ctx
        uint32_t n_slots
        int32_t n_threads
        uint32_t n_ubatch
        bool flash_attn
        bool batch_invariant
        string type_k
        string type_v
        string device
        bool use_mmap
        uint64_t device_memory_limit
        uint64_t kv_budget
        bool mtp
        uint32_t state_snapshots

    cdef cppclass CEngineCounters "dgr::Engine::Counters":
        int64_t forwards
        int64_t decodes
        int64_t ubatches
        int64_t forward_ns
        int64_t decode_ns
        int64_t graphs_reused

    cdef cppclass CEngineInfo "dgr::EngineInfo":
        string arch
        string desc
        int32_t n_layer
        int32_t layer_start
        int32_t layer_end
        int32_t n_embd
        int32_t n_embd_boundary
        int32_t n_vocab
        int32_t n_ctx_train
        uint32_t n_ctx
        string n_ctx_source
        uint32_t n_ctx_alloc
        uint32_t n_slots
        uint32_t n_ubatch
        int32_t n_threads
        bool flash_attn
        bool batch_invariant
        string type_k
        string type_v
        int32_t hash_layer_count
        bool needs_token_ids
        uint64_t n_params
        uint64_t weight_bytes
        uint64_t kv_bytes
        uint64_t compute_bytes
        string device
        string device_desc
        string device_type
        string backend
        string device_driver
        uint64_t device_memory_free
        uint64_t device_memory_total
        uint64_t device_weight_bytes
        uint64_t device_kv_bytes
        uint64_t device_compute_bytes
        int32_t token_bos
        int32_t token_eos
        bool add_bos
        bool mtp
        int32_t n_layer_nextn
        int32_t rollback_window
        uint64_t state_bytes
        uint32_t state_snapshots
        int32_t n_embd_inp
        int32_t n_pos_per_embd

    cdef cppclass CMediaStep "dgr::MediaStep":
        const float * rows
        const int32_t * pos
        int32_t n_sections
        bool causal

    cdef cppclass CEngine "dgr::Engine":
        @staticmethod
        CStatus Load(const CEngineConfig & cfg, unique_ptr[CEngine] * out) except +
        const CEngineInfo & info()
        bool is_first()
        bool is_last()
        CStatus Tokenize(const string & text, bool add_special, bool parse_special,
                         vector[int32_t] * out) except +
        CStatus Detokenize(const int32_t * tokens, size_t n, bool remove_special,
                           bool unparse_special, string * out) except +
        CStatus TokenPieces(int32_t first, int32_t count, bint special, string * out,
                            vector[int32_t] * ends) except +
        bool IsEog(int32_t token) except +
        int32_t OutputWidth()
        CStatus Forward(int32_t slot, const int32_t * pos, const int32_t * tokens,
                        const float * boundary, int32_t n_tokens, const uint8_t * want,
                        float * out, size_t out_capacity, int32_t * n_out_rows) except +
        CStatus ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                             const float * boundary, int32_t n_tokens, const uint8_t * want,
                             float * out, size_t out_capacity, int32_t * n_out_rows) except +
        CStatus ForwardMedia(int32_t slot, const CMediaStep & step, int32_t n_tokens,
                             const uint8_t * want, float * out, size_t out_capacity,
                             int32_t * n_out_rows) except +
        CStatus Embed(int32_t slot, const int32_t * pos, const int32_t * tokens,
                      const float * boundary, int32_t n_tokens, float * out, size_t out_capacity,
                      int32_t * n_out_rows) except +
        CStatus Release(int32_t slot) except +
        CStatus CopySlot(int32_t src, int32_t dst) except +
        CStatus Truncate(int32_t slot, int32_t pos) except +
        CStatus MtpDraft(int32_t slot, int32_t token, int32_t n_max, vector[int32_t] * out) except +
        int32_t NextPos(int32_t slot) except +
        vector[int32_t] StateSnapshots(int32_t slot) except +
        uint64_t StateSnapshotBytes() except +
        int64_t GraphsReused() except +
        CEngineCounters GetCounters() except +
        CStatus RefreshMemory() except +
        CStatus InjectFault(const string & what) except +

    cdef cppclass CDeviceInfo "dgr::DeviceInfo":
        string name
        string description
        string type
        string backend
        string device_id
        string driver
        uint64_t memory_free
        uint64_t memory_total

    CStatus ListDevices(vector[CDeviceInfo] * out) except +
    vector[string] BuiltBackends() except +
    vector[string] CpuFeatures() except +
    bool HasLayerRanges()
    bool ArchSupportsLayerRange(const string & arch)


cdef extern from "dgr/build_info.h":
    const char * DGR_LLAMA_COMMIT
    const char * DGR_PATCH_STACK_HASH
    const char * DGR_VENDOR_KEY
    const char * DGR_CPU_VARIANT


cdef extern from "dgr/media.h" namespace "dgr" nogil:
    cdef cppclass CMediaConfig "dgr::MediaConfig":
        string mmproj_path
        int32_t n_threads
        bool flash_attn
        bool warmup

    cdef cppclass CMediaInfo "dgr::MediaInfo":
        bool vision
        bool audio
        bool mrope
        int32_t audio_sample_rate
        int32_t n_embd_inp
        string marker

    cdef cppclass CMediaChunk "dgr::MediaChunk":
        int32_t kind
        vector[int32_t] tokens
        int32_t n_rows
        int32_t n_pos
        string id
        bool non_causal

    cdef cppclass CMedia "dgr::Media":
        @staticmethod
        CStatus Open(const CEngine & engine, const CMediaConfig & cfg,
                     unique_ptr[CMedia] * out) except +
        const CMediaInfo & info()
        CStatus Tokenize(const string & prompt, const vector[string] & media, bool add_special,
                         bool parse_special, vector[CMediaChunk] * out,
                         uint64_t max_pixels) except +
        CStatus Encode(size_t i, vector[float] * rows) except +
        CStatus Positions(size_t i, int32_t pos0, vector[int32_t] * pos) except +

    CStatus MtmdHelperLogits(const CEngineConfig & cfg, const CMediaConfig & media,
                             const string & prompt, const vector[string] & files,
                             bool add_special, bool parse_special, vector[float] * logits) except +
