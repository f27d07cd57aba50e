// MTP (NextN) drafting on the last stage: the catch-up decode after each trunk chunk, the
// kept trunk rows, and the greedy draft chain (the class is described in impl.h).

#include <algorithm>
#include <cstring>

#include "impl.h"

namespace dgr {
using namespace detail;

MtpDrafter::~MtpDrafter() {
    if (batch_.pos) {
        batch_.token = batch_token_;
        batch_.embd = nullptr;
        llama_batch_free(batch_);
    }
    if (ctx_) llama_free(ctx_);
}

Status MtpDrafter::Init(llama_model * model, llama_context * trunk, const llama_context_params & cp,
                        uint32_t n_slots, uint32_t n_ubatch) {
    // llama.cpp's own MTP context (common_speculative_init_result): the target's settings,
    // ctx_type MTP, no rollback snapshots (its memory is a plain KV cache of the NextN
    // block), the target as ctx_other
    llama_context_params mc = cp;
    mc.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    mc.n_rs_seq = 0;
    mc.ctx_other = trunk;
    ctx_ = llama_init_from_model(model, mc);
    if (!ctx_) {
        std::string why = log_last_error();
        return Status(kMtpNotSupported, "llama.cpp could not create the MTP context" +
                      (why.empty() ? std::string() : " (" + why + ")"));
    }
    // the NextN block's own hidden row of each logits row: the h of the next draft step
    llama_set_embeddings_nextn(ctx_, true, /*masked*/ true);
    llama_set_embeddings_layer_inp(ctx_, 0, false);  // a new graph plan, as for the trunk
    n_slots_ = n_slots;
    n_ubatch_ = n_ubatch;
    return Status();
}

void MtpDrafter::Size(int32_t width, int32_t n_vocab) {
    W_ = (size_t) width;
    n_vocab_ = n_vocab;
    batch_ = llama_batch_init((int32_t) n_ubatch_, 0, 1);
    batch_token_ = batch_.token;
    for (uint32_t i = 0; i < n_ubatch_; ++i) batch_.n_seq_id[i] = 1;
    embd_.assign((size_t) n_ubatch_ * W_, 0.0f);
    zeros_.assign(W_, 0.0f);
    seq_.assign(n_ubatch_, 0);
    tok_.assign(n_ubatch_, 0);
    slots_.resize(n_slots_);
    for (auto & sl : slots_) sl.rows.assign((size_t) kRows * W_, 0.0f);
}

void MtpDrafter::Clear(int32_t slot) {
    llama_memory_seq_rm(llama_get_memory(ctx_), slot, -1, -1);
    slots_[slot].pos0 = 0;
    slots_[slot].n = 0;
}

std::string MtpDrafter::CannotTruncate(int32_t slot, int32_t pos) const {
    const Slot & ms = slots_[slot];
    if (pos - 1 < ms.pos0 || pos - 1 >= ms.pos0 + ms.n) {
        return "MTP keeps the trunk's hidden rows of the last " + std::to_string(kRows) +
               " positions only (" + std::to_string(ms.pos0) + ".." + std::to_string(ms.pos0 + ms.n - 1) +
               "), not that of position " + std::to_string(pos - 1);
    }
    return "";
}

bool MtpDrafter::Truncate(int32_t slot, int32_t pos) {
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), slot, pos, -1)) return false;
    Slot & ms = slots_[slot];
    ms.n = pos - ms.pos0;  // the last row kept is the trunk's h at pos-1: the pending h
    return true;
}

int32_t MtpDrafter::CatchUp(const llama_pos * pos, const float * h, int32_t n) {
    llama_batch & b = batch_;
    // the pairs (x_q, h_{q-1}), gathered before this chunk's rows are kept
    for (int32_t k = 0; k < n; ++k) {
        const bool cont = k > 0 && seq_[k - 1] == seq_[k];
        const float * prev = cont ? h + (size_t) (k - 1) * W_ : PrevH(seq_[k], pos[k]);
        std::memcpy(embd_.data() + (size_t) k * W_, prev, sizeof(float) * W_);
        b.token[k] = tok_[k];
        b.pos[k] = pos[k];
        b.seq_id[k][0] = seq_[k];
        b.logits[k] = 0;
    }
    for (int32_t k = 0; k < n;) {
        int32_t e = k + 1;
        while (e < n && seq_[e] == seq_[k]) ++e;
        KeepRows(seq_[k], pos[k], h + (size_t) k * W_, e - k);
        k = e;
    }
    b.n_tokens = n;
    b.embd = embd_.data();
    int32_t rc;
    try {
        rc = llama_decode(ctx_, b);
    } catch (...) {
        b.embd = nullptr;
        throw;
    }
    b.embd = nullptr;
    return rc;
}

Status MtpDrafter::Draft(int32_t slot, int32_t pos0, int32_t token, int32_t n,
                         std::vector<int32_t> * out, bool * stuck) {
    *stuck = false;
    llama_memory_t mem = llama_get_memory(ctx_);
    const int32_t V = n_vocab_;
    llama_batch & b = batch_;
    float * h = embd_.data();
    std::memcpy(h, PrevH(slot, pos0), sizeof(float) * W_);
    auto failed = [&](const std::string & why) {
        // the MTP memory past pos0 is the draft's own: drop it; the slot keeps its state
        llama_memory_seq_rm(mem, slot, pos0, -1);
        out->clear();
        return Status(kEngineError, "MTP draft of slot " + std::to_string(slot) + " failed: " + why);
    };
    int32_t tok = token;
    try {
        for (int32_t i = 0; i < n; ++i) {
            b.n_tokens = 1;
            b.token[0] = tok;
            b.pos[0] = pos0 + i;
            b.seq_id[0][0] = slot;
            b.logits[0] = 1;
            b.embd = h;
            const int32_t rc = llama_decode(ctx_, b);
            b.embd = nullptr;
            if (rc != 0) {
                std::string why = log_last_error();
                return failed("llama_decode returned " + std::to_string(rc) + (why.empty() ? "" : ": " + why));
            }
            const float * lg = llama_get_logits_ith(ctx_, 0);
            if (!lg) return failed("llama.cpp returned no MTP logits");
            int32_t best = 0;
            for (int32_t v = 1; v < V; ++v) {
                if (lg[v] > lg[best]) best = v;  // strict: the lowest id wins a tie
            }
            out->push_back(best);
            if (i + 1 < n) {
                const float * hn = llama_get_embeddings_nextn_ith(ctx_, 0);
                if (!hn) return failed("llama.cpp returned no NextN hidden row");
                std::memcpy(h, hn, sizeof(float) * W_);
            }
            tok = best;
        }
    } catch (...) {
        b.embd = nullptr;
        return failed(current_exception_text());
    }
    if (!llama_memory_seq_rm(mem, slot, pos0, -1)) {
        *stuck = true;
        out->clear();
        return Status(kEngineError, "the MTP cache could not drop the draft of slot " + std::to_string(slot) +
                      "; the slot was cleared and must be re-prefilled");
    }
    return Status();
}

const float * MtpDrafter::PrevH(int32_t slot, int32_t pos) const {
    const Slot & ms = slots_[slot];
    if (pos <= 0 || ms.n <= 0 || pos - 1 != ms.pos0 + ms.n - 1) return zeros_.data();
    return ms.rows.data() + (size_t) (ms.n - 1) * W_;
}

void MtpDrafter::KeepRows(int32_t slot, int32_t pos, const float * h, int32_t n) {
    Slot & ms = slots_[slot];
    if (ms.n > 0 && ms.pos0 + ms.n != pos) ms.n = 0;  // not a continuation: start over
    if (ms.n == 0) ms.pos0 = pos;
    if (n >= kRows) {
        std::memcpy(ms.rows.data(), h + (size_t) (n - kRows) * W_, sizeof(float) * W_ * kRows);
        ms.pos0 = pos + n - kRows;
        ms.n = kRows;
        return;
    }
    const int32_t drop = std::max(0, ms.n + n - kRows);
    if (drop > 0) {
        std::memmove(ms.rows.data(), ms.rows.data() + (size_t) drop * W_, sizeof(float) * W_ * (ms.n - drop));
        ms.pos0 += drop;
        ms.n -= drop;
    }
    std::memcpy(ms.rows.data() + (size_t) ms.n * W_, h, sizeof(float) * W_ * n);
    ms.n += n;
}

}  // namespace dgr
