// dgr::Media: a model's projector (an mmproj GGUF) through the pinned tree's own libmtmd,
// beside the stage that embeds the tokens (the first). It cuts a prompt with media markers
// into text and media chunks (mtmd_tokenize), encodes a media chunk into embedding rows
// (mtmd_encode_chunk) and says each chunk's positions and causality (mtmd's decoder positions,
// mtmd_decode_use_non_causal): what Engine::ForwardMedia takes on every stage.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dgr/engine.h"
#include "dgr/status.h"

namespace dgr {

struct MediaConfig {
    std::string mmproj_path;
    int32_t n_threads = 1;
    bool flash_attn = true;   // the encoder's attention (as llama-server's --flash-attn)
    bool warmup = false;      // mtmd's warmup encode at load (a few hundred MB on some projectors)
};

struct MediaInfo {
    bool vision = false;
    bool audio = false;
    bool mrope = false;          // mtmd_decode_use_mrope: rows take (t, y, x, z) positions
    int32_t audio_sample_rate = -1;
    int32_t n_embd_inp = 0;      // an encoded row's width (the text model's n_embd_inp)
    std::string marker;          // the prompt's media marker (mtmd's default: <__media__>)
};

struct MediaChunk {
    int32_t kind = 0;            // 0 text, 1 image, 2 audio (mtmd_input_chunk_type)
    std::vector<int32_t> tokens; // a text chunk's token ids
    int32_t n_rows = 0;          // rows it takes in the cache (tokens, or encoded rows)
    int32_t n_pos = 0;           // positions it advances (an M-RoPE image: fewer than its rows)
    std::string id;              // a media chunk's bitmap id (the SHA-256 of its file's bytes)
    bool non_causal = false;     // its rows attend both ways (mtmd_decode_use_non_causal)
};

class Media {
public:
    ~Media();
    Media(const Media &) = delete;
    Media & operator=(const Media &) = delete;

    // Open the projector for `engine`'s model (the first stage, or the whole model): its
    // rows must be as wide as that model's input. kInvalidModel if libmtmd refuses it.
    static Status Open(const Engine & engine, const MediaConfig & cfg, std::unique_ptr<Media> * out);

    const MediaInfo & info() const noexcept;

    // Cut `prompt` (with one marker per media item) into chunks, the media given as their
    // files' bytes (images as stb_image reads them, audio as wav/mp3/flac; a chunk's id is
    // the SHA-256 of its bytes, mtmd's bitmap id). The chunks are kept here until the next
    // Tokenize, for Encode and Positions. kInvalidArgument for a marker count that is not the
    // media count, or media libmtmd cannot decode or preprocess, or an image whose header
    // says it has more than `max_pixels` pixels (width x height, read before it is decoded;
    // 0: no cap).
    Status Tokenize(const std::string & prompt, const std::vector<std::string> & media,
                    bool add_special, bool parse_special, std::vector<MediaChunk> * out,
                    uint64_t max_pixels = 0);
    // The embedding rows of the last Tokenize's media chunk `i` (n_rows * n_embd_inp floats).
    Status Encode(size_t i, std::vector<float> * rows);
    // Chunk `i`'s positions from pos0: n_rows of them, or on an M-RoPE model 4 * n_rows,
    // section-major (what MediaStep::pos takes).
    Status Positions(size_t i, int32_t pos0, std::vector<int32_t> * pos) const;

private:
    Media();
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// llama.cpp's own path, for parity: the whole model in a plain llama_context (the engine's
// numeric settings, one slot) evaluating `prompt`'s chunks with mtmd_helper_eval_chunks, and
// the last row's logits. The reference dgr's media steps are compared with.
Status MtmdHelperLogits(const EngineConfig & cfg, const MediaConfig & media, const std::string & prompt,
                        const std::vector<std::string> & files, bool add_special, bool parse_special,
                        std::vector<float> * logits);

}  // namespace dgr
