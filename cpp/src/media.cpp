// dgr::Media: libmtmd of the pinned tree beside the first stage, and its own
// mtmd_helper_eval_chunks path as the parity reference (media.h).

#include "dgr/media.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "engine/impl.h"
#include "mtmd-helper.h"
#include "mtmd.h"

// stb_image's header probe, from the copy libmtmd's helper compiles (mtmd-helper.cpp)
extern "C" int stbi_info_from_memory(const unsigned char * buffer, int len, int * x, int * y, int * comp);

namespace dgr {
using namespace detail;

namespace {

// mtmd logs through its own callback: into the engine's log capture, once per process
void route_mtmd_log() {
    static std::once_flag once;
    std::call_once(once, [] { mtmd_helper_log_set(log_cb, nullptr); });
}

mtmd_context_params context_params(const MediaConfig & cfg, ggml_backend_dev_t dev, bool on_cpu) {
    mtmd_context_params p = mtmd_context_params_default();
    p.use_gpu = !on_cpu;
    p.device = on_cpu ? nullptr : dev;
    p.print_timings = false;
    p.n_threads = std::max(1, cfg.n_threads);
    p.flash_attn_type = cfg.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    p.warmup = cfg.warmup;
    return p;
}

struct Chunks {
    mtmd_input_chunks * p = mtmd_input_chunks_init();
    ~Chunks() { mtmd_input_chunks_free(p); }
};

struct Bitmaps {
    std::vector<mtmd_bitmap *> v;
    ~Bitmaps() {
        for (mtmd_bitmap * b : v) mtmd_bitmap_free(b);
    }
};

// An image's size from its header, before the decoder allocates its pixels: refused past
// `max_pixels` (a small file may claim a huge image). stb_image is libmtmd's decoder, linked
// in with it; a file it cannot read the header of is left to the decoder (audio, or corrupt).
Status check_pixels(const std::string & f, size_t i, uint64_t max_pixels) {
    int w = 0, h = 0, comp = 0;
    if (max_pixels == 0 || f.size() > (size_t) INT32_MAX ||
        !stbi_info_from_memory(reinterpret_cast<const unsigned char *>(f.data()), (int) f.size(), &w, &h, &comp)) {
        return Status();
    }
    if ((uint64_t) w * (uint64_t) h > max_pixels) {
        return Status(kInvalidArgument, "media item " + std::to_string(i) + " is a " + std::to_string(w) + "x" +
                      std::to_string(h) + " image: more than the " + std::to_string(max_pixels) +
                      " pixels this server decodes");
    }
    return Status();
}

// mtmd_tokenize of `prompt` with the media files' bitmaps into `chunks`
Status tokenize(mtmd_context * ctx, const std::string & prompt, const std::vector<std::string> & files,
                bool add_special, bool parse_special, mtmd_input_chunks * chunks, uint64_t max_pixels) {
    Bitmaps bm;
    for (size_t i = 0; i < files.size(); ++i) {
        const std::string & f = files[i];
        Status px = check_pixels(f, i, max_pixels);
        if (!px.ok()) return px;
        mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_buf(
            ctx, reinterpret_cast<const unsigned char *>(f.data()), f.size(), false,
            mtmd_helper_init_opt_default());
        if (!w.bitmap) {
            return Status(kInvalidArgument, "media item " + std::to_string(i) + " (" + std::to_string(f.size()) +
                          " bytes) is not an image or audio file libmtmd can decode");
        }
        bm.v.push_back(w.bitmap);
        if (mtmd_bitmap_is_audio(w.bitmap) ? !mtmd_support_audio(ctx) : !mtmd_support_vision(ctx)) {
            return Status(kInvalidArgument, std::string("media item ") + std::to_string(i) + " is " +
                          (mtmd_bitmap_is_audio(w.bitmap) ? "audio" : "an image") + ", which this projector does not take");
        }
    }
    mtmd_input_text text{prompt.c_str(), prompt.size(), add_special, parse_special};
    std::vector<const mtmd_bitmap *> ptrs(bm.v.begin(), bm.v.end());
    const int32_t rc = mtmd_tokenize(ctx, chunks, &text, ptrs.data(), ptrs.size());
    if (rc == 1) {
        return Status(kInvalidArgument, "the prompt has a different number of media markers (" +
                      std::string(mtmd_get_marker(ctx)) + ") than the " + std::to_string(files.size()) +
                      " media item(s)");
    }
    if (rc != 0) {
        const std::string why = log_last_error();
        return Status(kInvalidArgument, "libmtmd could not preprocess the media (code " + std::to_string(rc) + ")" +
                      (why.empty() ? std::string() : ": " + why));
    }
    return Status();
}

}  // namespace

struct Media::Impl {
    mtmd_context * ctx = nullptr;
    MediaInfo info;
    Chunks chunks;  // the last Tokenize's
    ~Impl() {
        if (ctx) mtmd_free(ctx);
    }
    const mtmd_input_chunk * Chunk(size_t i) const {
        return i < mtmd_input_chunks_size(chunks.p) ? mtmd_input_chunks_get(chunks.p, i) : nullptr;
    }
};

Media::Media() : impl_(new Impl) {}
Media::~Media() = default;

const MediaInfo & Media::info() const noexcept { return impl_->info; }

Status Media::Open(const Engine & engine, const MediaConfig & cfg, std::unique_ptr<Media> * out) {
    return guarded("media_open", [&]() -> Status {
        const Engine::Impl & e = *engine.impl_;
        if (!e.first) {
            return Status(kInvalidArgument, "a projector runs beside the first stage (layers from 0), which "
                          "embeds the tokens; this stage starts at layer " + std::to_string(e.info.layer_start));
        }
        route_mtmd_log();
        log_clear();
        std::unique_ptr<Media> m(new Media());
        m->impl_->ctx = mtmd_init_from_file(cfg.mmproj_path.c_str(), e.model, context_params(cfg, e.dev, e.on_cpu));
        if (!m->impl_->ctx) {
            const std::string why = log_last_error();
            return Status(kInvalidModel, "libmtmd could not open the projector " + cfg.mmproj_path + " for " +
                          e.info.arch + " (" + std::to_string(e.info.n_embd_inp) + "-wide input rows)" +
                          (why.empty() ? std::string() : ": " + why));
        }
        MediaInfo & in = m->impl_->info;
        mtmd_context * c = m->impl_->ctx;
        in.vision = mtmd_support_vision(c);
        in.audio = mtmd_support_audio(c);
        in.mrope = mtmd_decode_use_mrope(c);
        in.audio_sample_rate = in.audio ? mtmd_get_audio_sample_rate(c) : -1;
        in.n_embd_inp = e.info.n_embd_inp;
        in.marker = mtmd_get_marker(c);
        if (in.mrope && e.info.n_pos_per_embd < 4) {
            return Status(kInvalidModel, "the projector " + cfg.mmproj_path + " gives M-RoPE positions, but " +
                          e.info.arch + " takes one position per row");
        }
        *out = std::move(m);
        return Status();
    });
}

Status Media::Tokenize(const std::string & prompt, const std::vector<std::string> & media, bool add_special,
                       bool parse_special, std::vector<MediaChunk> * out, uint64_t max_pixels) {
    return guarded("media_tokenize", [&]() -> Status {
        Impl & m = *impl_;
        out->clear();
        log_clear();
        Chunks fresh;
        Status st = tokenize(m.ctx, prompt, media, add_special, parse_special, fresh.p, max_pixels);
        if (!st.ok()) return st;
        std::swap(m.chunks.p, fresh.p);
        for (size_t i = 0; i < mtmd_input_chunks_size(m.chunks.p); ++i) {
            const mtmd_input_chunk * c = mtmd_input_chunks_get(m.chunks.p, i);
            MediaChunk mc;
            mc.kind = (int32_t) mtmd_input_chunk_get_type(c);
            mc.n_rows = (int32_t) mtmd_input_chunk_get_n_tokens(c);
            mc.n_pos = (int32_t) mtmd_input_chunk_get_n_pos(c);
            if (mc.kind == MTMD_INPUT_CHUNK_TYPE_TEXT) {
                size_t n = 0;
                const llama_token * t = mtmd_input_chunk_get_tokens_text(c, &n);
                mc.tokens.assign(t, t + n);
            } else {
                const char * id = mtmd_input_chunk_get_id(c);
                mc.id = id ? id : "";
                mc.non_causal = mtmd_decode_use_non_causal(m.ctx, c);
            }
            out->push_back(std::move(mc));
        }
        return Status();
    });
}

Status Media::Encode(size_t i, std::vector<float> * rows) {
    return guarded("media_encode", [&]() -> Status {
        Impl & m = *impl_;
        const mtmd_input_chunk * c = m.Chunk(i);
        if (!c || mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            return Status(kInvalidArgument, "chunk " + std::to_string(i) + " of the last prompt is not a media chunk");
        }
        log_clear();
        if (mtmd_encode_chunk(m.ctx, c) != 0) {
            const std::string why = log_last_error();
            return Status(kEngineError, "libmtmd could not encode media chunk " + std::to_string(i) +
                          (why.empty() ? std::string() : ": " + why));
        }
        const size_t n = mtmd_input_chunk_get_n_tokens(c) * (size_t) m.info.n_embd_inp;
        const float * e = mtmd_get_output_embd(m.ctx);
        rows->assign(e, e + n);
        return Status();
    });
}

Status Media::Positions(size_t i, int32_t pos0, std::vector<int32_t> * pos) const {
    const Impl & m = *impl_;
    const mtmd_input_chunk * c = m.Chunk(i);
    if (!c) return Status(kInvalidArgument, "the last prompt has no chunk " + std::to_string(i));
    const size_t n = mtmd_input_chunk_get_n_tokens(c);
    const auto type = mtmd_input_chunk_get_type(c);
    if (!m.info.mrope) {
        pos->resize(n);
        for (size_t k = 0; k < n; ++k) (*pos)[k] = pos0 + (int32_t) k;
        return Status();
    }
    // as mtmd-helper's decode_embd_batch: an image's (t, y, x, z), audio's and text's p, p, p, p
    pos->assign(4 * n, 0);
    if (type == MTMD_INPUT_CHUNK_TYPE_IMAGE) {
        std::vector<mtmd_decoder_pos> rel(n);
        mtmd_helper_image_get_decoder_pos(mtmd_input_chunk_get_tokens_image(c), pos0, rel.data());
        for (size_t k = 0; k < n; ++k) {
            (*pos)[k] = (int32_t) rel[k].t;
            (*pos)[n + k] = (int32_t) rel[k].y;
            (*pos)[2 * n + k] = (int32_t) rel[k].x;
            (*pos)[3 * n + k] = (int32_t) rel[k].z;
        }
    } else {
        for (size_t j = 0; j < 4; ++j) {
            for (size_t k = 0; k < n; ++k) (*pos)[j * n + k] = pos0 + (int32_t) k;
        }
    }
    return Status();
}

Status MtmdHelperLogits(const EngineConfig & cfg, const MediaConfig & media, const std::string & prompt,
                        const std::vector<std::string> & files, bool add_special, bool parse_special,
                        std::vector<float> * logits) {
    return guarded("mtmd_helper_logits", [&]() -> Status {
        log_clear();
        route_mtmd_log();
        if (cfg.device != "cpu") return Status(kInvalidArgument, "the mtmd reference runs on the CPU");
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = 0;
        ggml_backend_dev_t none[1] = {nullptr};
        mp.devices = none;
        llama_model * model = llama_model_load_from_file(cfg.model_path.c_str(), mp);
        if (!model) return Status(kInvalidModel, "llama.cpp could not load " + cfg.model_path);
        struct ModelFree { llama_model * p; ~ModelFree() { llama_model_free(p); } } mf{model};
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = cfg.n_ctx;
        cp.n_batch = cfg.n_ubatch;
        cp.n_ubatch = cfg.n_ubatch;
        cp.n_seq_max = 1;
        cp.n_threads = cfg.n_threads;
        cp.n_threads_batch = cfg.n_threads;
        cp.flash_attn_type = cfg.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        if (!parse_type(cfg.type_k, &cp.type_k) || !parse_type(cfg.type_v, &cp.type_v)) {
            return Status(kInvalidArgument, "unknown KV type " + cfg.type_k + "/" + cfg.type_v);
        }
        cp.kv_unified = false;
        cp.swa_full = true;
        cp.no_perf = true;
        cp.op_offload = false;
        llama_context * lctx = llama_init_from_model(model, cp);
        if (!lctx) return Status(kEngineError, "llama.cpp could not make a context for " + cfg.model_path);
        struct CtxFree { llama_context * p; ~CtxFree() { llama_free(p); } } cf{lctx};
        mtmd_context * mctx = mtmd_init_from_file(media.mmproj_path.c_str(), model, context_params(media, nullptr, true));
        if (!mctx) return Status(kInvalidModel, "libmtmd could not open the projector " + media.mmproj_path);
        struct MtmdFree { mtmd_context * p; ~MtmdFree() { mtmd_free(p); } } xf{mctx};
        Chunks chunks;
        Status st = tokenize(mctx, prompt, files, add_special, parse_special, chunks.p, 0);
        if (!st.ok()) return st;
        llama_pos n_past = 0;
        if (mtmd_helper_eval_chunks(mctx, lctx, chunks.p, 0, 0, (int32_t) cfg.n_ubatch, true, &n_past) != 0) {
            const std::string why = log_last_error();
            return Status(kEngineError, "mtmd_helper_eval_chunks failed" + (why.empty() ? std::string() : ": " + why));
        }
        const float * row = llama_get_logits_ith(lctx, -1);
        if (!row) return Status(kEngineError, "llama.cpp returned no logits for the last row");
        logits->assign(row, row + llama_vocab_n_tokens(llama_model_get_vocab(model)));
        return Status();
    });
}

}  // namespace dgr
