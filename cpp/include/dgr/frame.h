// dgr wire frames in C++: decode + validate, and encode, byte-compatible with
// dgr/protocol/wire.py (the spec is docs/wire.md; format version 1, schema version 4).
//
// decode_frame applies every check of wire.decode, in the same order, and fails with the same
// dgr::StatusCode (kFrameError .. kUnknownCodec) that wire.decode's exception carries (and,
// for the cross-field rules of wire._check_forward / _check_result, the same message). It
// handles every message (Forward, Result, ErrorReply, Hello) and the raw f32 codec without
// compression: the boundary is a pointer into the input (no copy). A frame with another codec
// (f16, bf16, q8) or zstd compression is checked as far as its payload checksum (rules 1-17 of
// docs/wire.md) and then refused with kFrameNotNative: the caller decodes it with
// wire.decode, which does the codec's own checks (zstd, q8 scales).
//
// One known difference: skipping unknown trailing header items is iterative here, so nesting
// deeper than Python's recursion limit (about 1000 levels, less the caller's stack depth) is
// accepted by C++ and refused by msgspec. In a message that quotes a string value (an unknown
// want, kind or speculate), a character above U+00FF that Python's repr() escapes as not
// printable is kept as it is.
//
// encode_* produce the same bytes as wire.encode(header, array) (codec raw, no compression) for
// Forward and Result, with the same checks and codes (kInvalidBoundary, kInvalidArgument).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dgr/status.h"

namespace dgr {
namespace wire {

constexpr uint8_t kFormatVersion = 1;
constexpr uint64_t kSchemaVersion = 6;
constexpr int32_t kMaxDraft = 32;  // wire.MAX_DRAFT: Forward.max_draft, drafts at most
constexpr int32_t kMropeSections = 4;  // wire.MROPE_SECTIONS: Forward.sections per row
constexpr size_t kPrefixSize = 16;
constexpr size_t kPayloadAlign = 64;
constexpr uint64_t kMaxPayload = 256ull << 20;
constexpr uint64_t kMaxHeader = 1ull << 20;

enum Tag : int { kNoTag = 0, kForward = 1, kResult = 2, kErrorReply = 3, kHello = 4 };

// Strings are views: into the frame after decode_frame (keep it alive), into the caller's
// storage for encode_*. Optional lists have a has_ flag (false: msgpack nil / Python None).
struct Sampling {
    double temperature = 1.0;
    int32_t top_k = 0;
    double top_p = 1.0;
    uint64_t seed = 0;
    bool greedy = false;
    double min_p = 0.0;
    std::vector<int32_t> bias_ids;  // as many as bias
    std::vector<double> bias;
    int32_t penalty_last_n = 0;
    double repeat_penalty = 1.0;
    double frequency_penalty = 0.0;
    double presence_penalty = 0.0;
    std::string_view grammar;  // into the frame's buffer (or a kept Python bytes)
    uint64_t grammar_id = 0;
    int32_t grammar_from = 0;
};

struct Hop {
    std::string_view endpoint;
    bool tokens = false;
};

struct Forward {
    uint64_t schema = kSchemaVersion;
    std::string_view model, session;
    int64_t epoch = 0;
    int32_t first_pos = 0, n_tokens = 0, layer = 0, width = 0, reserved = 1;
    std::string_view dtype = "f32", codec = "raw", compression = "none";
    int64_t payload_len = 0;
    uint64_t checksum = 0;
    bool has_positions = false, has_tokens = false, has_rows = false, has_sampling = false,
         has_relay = false, has_loop = false, has_stop_tokens = false;
    std::vector<int32_t> positions, tokens;
    std::string_view want = "boundary";
    std::vector<int32_t> rows;
    Sampling sampling;
    std::vector<Hop> relay;
    std::string_view reply_to;
    std::vector<Hop> loop;
    int32_t steps = 0;
    std::vector<int32_t> stop_tokens;
    bool solo = false;
    // schema 4, speculative decoding (docs/speculative.md)
    int32_t rollback = 0, drafts = 0;
    std::string_view speculate;  // wire.DRAFTERS: "" (none), "ngram", "mtp"
    int32_t max_draft = 0;
    // schema 6, media steps (docs/media.md)
    std::string_view media;      // wire.MEDIA: "" (none), "image", "audio"
    bool has_sections = false;
    std::vector<int32_t> sections;  // wire.MROPE_SECTIONS per row, section-major
    bool causal = true;

    void reset();  // the defaults, keeping the vectors' capacity
};

struct Result {
    uint64_t schema = kSchemaVersion;
    std::string_view session;
    int64_t epoch = 0;
    int32_t first_pos = 0, n_tokens = 0;
    std::string_view kind = "none";
    int32_t layer = 0, rows = 0, cols = 0, reserved = 1;
    std::string_view dtype = "f32", codec = "raw", compression = "none";
    int64_t payload_len = 0;
    uint64_t checksum = 0;
    bool has_tokens = false;
    std::vector<int32_t> tokens;
    int32_t drafted = 0;  // schema 4: drafts the step verified (Forward.drafts)

    void reset();
};

struct ErrorReply {
    uint64_t schema = kSchemaVersion;
    int32_t code = 0;
    std::string_view message, session;
    int64_t epoch = 0;
    bool has_retry_after = false;
    double retry_after = 0.0;
};

struct Hello {
    uint64_t schema = kSchemaVersion;
    std::string_view route;
};

// A decoded frame. Reuse one across calls: its vectors keep their capacity.
struct FrameView {
    Tag tag = kNoTag;
    Forward forward;        // valid when tag == kForward
    Result result;          // tag == kResult
    ErrorReply error;       // tag == kErrorReply
    Hello hello;            // tag == kHello
    // The f32 array [rows, cols] (row-major, little endian), a view into the frame; null when
    // the message has none. Aligned for float when the frame is 4-byte aligned.
    const float* array = nullptr;
    int64_t rows = 0, cols = 0;
    size_t payload_offset = 0;  // P: the array starts at data + payload_offset
};

struct DecodeLimits {
    uint64_t max_payload = kMaxPayload;
    uint64_t max_header = kMaxHeader;
};

// Validate and decode the frame data[0, size). On failure `out` is unspecified and the
// status code is the one wire.decode raises (kFrameNotNative: valid so far, decode it in
// Python). Never throws.
Status decode_frame(const uint8_t* data, size_t size, const DecodeLimits& limits,
                    FrameView* out) noexcept;

// An encoded frame as two pieces, for a copy into one buffer or a gather write (iovecs):
// `head` is prefix + msgpack header + zero padding, `payload` points at the caller's array.
struct EncodedFrame {
    std::string head;
    const uint8_t* payload = nullptr;
    size_t payload_len = 0;

    size_t size() const { return head.size() + payload_len; }
    void copy_to(uint8_t* dst) const;  // dst holds size() bytes
};

// Encode `h` with `array` ([rows, cols] f32, C-contiguous, little endian; null for none) as
// wire.encode does with codec raw and no compression: width (Forward) or rows/cols (Result),
// dtype, codec, compression, payload_len and checksum are filled in, whatever `h` holds.
// `out` keeps pointing at `array`. Errors: kInvalidBoundary (array shape vs header),
// kInvalidArgument (the cross-field rules). Never throws (std::bad_alloc aside).
Status encode_forward(const Forward& h, const float* array, int64_t rows, int64_t cols,
                      EncodedFrame* out);
Status encode_result(const Result& h, const float* array, int64_t rows, int64_t cols,
                     EncodedFrame* out);

// XXH3-64 (seed 0) of data[0, size): the wire's checksum.
uint64_t checksum(const void* data, size_t size) noexcept;

}  // namespace wire
}  // namespace dgr
