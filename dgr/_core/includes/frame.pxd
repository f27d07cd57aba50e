# Declarations of cpp/include/dgr/frame.h: the wire frame decoder and encoder (noexcept in
# C++ but for allocations: the encoders are `except +` for std::bad_alloc).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.string_view cimport string_view
from libcpp.vector cimport vector

from dgr._core.includes.engine cimport CStatus


cdef extern from "dgr/frame.h" namespace "dgr::wire" nogil:
    cdef uint64_t kMaxPayload
    cdef uint64_t kMaxHeader

    cdef enum CTag "dgr::wire::Tag":
        kNoTag "dgr::wire::kNoTag"
        kForward "dgr::wire::kForward"
        kResult "dgr::wire::kResult"
        kErrorReply "dgr::wire::kErrorReply"
        kHello "dgr::wire::kHello"

    cdef cppclass CSampling "dgr::wire::Sampling":
        double temperature
        int32_t top_k
        double top_p
        uint64_t seed
        bool greedy
        double min_p
        vector[int32_t] bias_ids
        vector[double] bias
        int32_t penalty_last_n
        double repeat_penalty
        double frequency_penalty
        double presence_penalty
        string_view grammar
        uint64_t grammar_id
        int32_t grammar_from

    cdef cppclass CHop "dgr::wire::Hop":
        string_view endpoint
        bool tokens

    cdef cppclass CForward "dgr::wire::Forward":
        uint64_t schema
        string_view model, session
        int64_t epoch
        int32_t first_pos, n_tokens, layer, width, reserved
        string_view dtype, codec, compression
        int64_t payload_len
        uint64_t checksum
        bool has_positions, has_tokens, has_rows, has_sampling, has_relay, has_loop
        bool has_stop_tokens
        vector[int32_t] positions, tokens
        string_view want
        vector[int32_t] rows
        CSampling sampling
        vector[CHop] relay
        string_view reply_to
        vector[CHop] loop
        int32_t steps
        vector[int32_t] stop_tokens
        bint solo
        int32_t rollback, drafts
        string_view speculate
        int32_t max_draft
        string_view media
        bint has_sections
        vector[int32_t] sections
        bint causal

    cdef cppclass CResult "dgr::wire::Result":
        uint64_t schema
        string_view session
        int64_t epoch
        int32_t first_pos, n_tokens
        string_view kind
        int32_t layer, rows, cols, reserved
        string_view dtype, codec, compression
        int64_t payload_len
        uint64_t checksum
        bool has_tokens
        vector[int32_t] tokens
        int32_t drafted

    cdef cppclass CErrorReply "dgr::wire::ErrorReply":
        uint64_t schema
        int32_t code
        string_view message, session
        int64_t epoch
        bool has_retry_after
        double retry_after

    cdef cppclass CHello "dgr::wire::Hello":
        uint64_t schema
        string_view route

    cdef cppclass CFrameView "dgr::wire::FrameView":
        CTag tag
        CForward forward
        CResult result
        CErrorReply error
        CHello hello
        const float * array
        int64_t rows, cols
        size_t payload_offset

    cdef cppclass CDecodeLimits "dgr::wire::DecodeLimits":
        uint64_t max_payload
        uint64_t max_header

    cdef cppclass CEncodedFrame "dgr::wire::EncodedFrame":
        string head
        const uint8_t * payload
        size_t payload_len
        size_t size()
        void copy_to(uint8_t * dst)

    CStatus decode_frame(const uint8_t * data, size_t size, const CDecodeLimits & limits,
                         CFrameView * out)
    CStatus encode_forward(const CForward & h, const float * array, int64_t rows, int64_t cols,
                           CEncodedFrame * out) except +
    CStatus encode_result(const CResult & h, const float * array, int64_t rows, int64_t cols,
                          CEncodedFrame * out) except +


from posix.uio cimport iovec


cdef extern from "dgr/frame_io.h" namespace "dgr::wire" nogil:
    cdef int kIoEof
    cdef int kIoTruncated
    cdef int kIoTooLarge
    cdef int kIoNeedBuffer
    cdef int kIoTimeout

    int recv_frame(int fd, uint8_t * buf, size_t cap, size_t max_frame, int64_t timeout_ms,
                   size_t * size, int64_t spin_us)
    int recv_exact(int fd, uint8_t * buf, size_t n, int64_t timeout_ms)
    int send_frame(int fd, const uint8_t * head, size_t head_len, const uint8_t * payload,
                   size_t payload_len)
    bool readable(int fd)
    int send_iov(int fd, iovec * iov, int count, size_t * sent)
    void length_prefix(size_t n, uint8_t * out)
