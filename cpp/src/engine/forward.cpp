// The stage's forward: inputs checked, batches decoded in ubatch chunks, rows out.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "impl.h"

namespace dgr {
using namespace detail;

// What a stage takes, checked before any compute: token ids on the first stage (and on one
// that owns hash-routed layers), a boundary on every other, and ids inside the vocabulary.
Status Engine::Impl::CheckStageInputs(const int32_t * tokens, const float * boundary,
                                      int32_t n_tokens) const {
    const Impl & m = *this;
    const EngineInfo & in = m.info;
    if (m.first && !tokens) {
        return Status(kInvalidArgument, "the first stage (layers starting at 0) takes token ids");
    }
    if (m.first && boundary) {
        return Status(kInvalidBoundary, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") is the first stage: it takes token ids, "
                      "not a boundary");
    }
    if (!m.first && !boundary) {
        return Status(kInvalidBoundary, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") takes a boundary array of shape [n_tokens, " +
                      std::to_string(in.n_embd_boundary) + "] from the stage before it");
    }
    if (!m.first && in.needs_token_ids && !tokens) {
        return Status(kMissingTokenIds, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") " +
                      (!m.trunk_tokens ? std::string("drafts with MTP (its NextN block embeds the tokens)")
                       : in.hash_layer_count > in.layer_start
                           ? "owns hash-routed layers (hash_layer_count=" + std::to_string(in.hash_layer_count) + ")"
                           : in.arch == "cogvlm" ? std::string("cogvlm's layers take their text weights for rows of token ids")
                           : in.arch == "qwen4exp" ? std::string("qwen4exp's layers read per-layer embeddings gathered by the token ids")
                           : in.arch + "'s layers read the token embeddings (a skip connection)") +
                      " and needs the token ids with the boundary");
    }
    if (tokens) {
        for (int32_t i = 0; i < n_tokens; ++i) {
            if (tokens[i] < 0 || tokens[i] >= in.n_vocab) {
                return Status(kInvalidToken, "token id " + std::to_string(tokens[i]) + " at index " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(in.n_vocab) + ")");
            }
        }
    }
    return Status();
}

int32_t Engine::Impl::Decode(int32_t n) {
    if (!throw_in_decode.empty()) {  // a fault a test injected, as a backend would throw it
        const std::string what = throw_in_decode;
        throw_in_decode.clear();
        throw std::runtime_error(what);
    }
    llama_batch & b = batch;
    // an embedding batch without token ids on an M-RoPE model: the sectioned positions
    llama_pos * const own_pos = b.pos;
    if (!b.token && b.embd && n_pos_sections > 1) {
        llama_pos * ps = pos_sections.data();
        if (media && media->n_sections > 1) {  // the step's own sections (mtmd's t, y, x, z)
            const int32_t * mp = media->pos;
            const size_t total = (size_t) media_total;
            for (int32_t j = 0; j < n_pos_sections; ++j) {
                for (int32_t i = 0; i < n; ++i) ps[(size_t) j * n + i] = mp[j * total + media_row + i];
            }
        } else {
            for (int32_t i = 0; i < n; ++i) {
                ps[i] = ps[n + i] = ps[2 * n + i] = own_pos[i];
                ps[3 * n + i] = 0;
            }
        }
        b.pos = ps;
    }
    int32_t rc;
    try {
        rc = llama_decode(ctx, b);
    } catch (...) {
        b.pos = own_pos;  // llama_batch_free frees the batch's own array
        throw;
    }
    b.pos = own_pos;
    b.token = nullptr;
    b.embd = nullptr;
    return rc;
}

// A step of one slot is a batch of one slot: the one forward core is ForwardBatch. Only the
// checks whose words are a single slot's are made here (a contiguous run of positions).
Status Engine::Impl::Forward(int32_t slot, const int32_t * pos, const int32_t * tokens,
                             const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                             size_t out_capacity, int32_t * n_out_rows) {
    Impl & m = *this;
    *n_out_rows = 0;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    if (!pos) return Status(kInvalidPosition, "positions are required");
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (pos[i] != pos[0] + i) {
            return Status(kInvalidPosition, "positions must be contiguous: position " + std::to_string(pos[i]) +
                          " at index " + std::to_string(i) + " should be " + std::to_string(pos[0] + i));
        }
    }
    m.one_slot.assign((size_t) n_tokens, slot);
    return m.ForwardBatch(m.one_slot.data(), pos, tokens, boundary, n_tokens, want, out, out_capacity,
                          n_out_rows);
}

Status Engine::Impl::ForwardMedia(int32_t slot, const MediaStep & step, int32_t n_tokens,
                                  const uint8_t * want, float * out, size_t out_capacity,
                                  int32_t * n_out_rows) {
    Impl & m = *this;
    const EngineInfo & in = m.info;
    *n_out_rows = 0;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (n_tokens <= 0) return Status(kInvalidArgument, "a media step needs at least one row");
    if (!step.rows) {
        return Status(kInvalidBoundary, m.first ? "a media step on the first stage needs its embedding rows"
                                                : "a media step needs the boundary from the stage before it");
    }
    if (!step.pos) return Status(kInvalidPosition, "positions are required");
    if (step.n_sections != 1 && step.n_sections != in.n_pos_per_embd) {
        return Status(kInvalidPosition, "a media step's positions have 1 or " + std::to_string(in.n_pos_per_embd) +
                      " sections on this model, not " + std::to_string(step.n_sections));
    }
    // layers that read the token ids themselves (hash-routed experts, a token-embedding skip,
    // per-layer embeddings, the NextN block): media rows have none
    bool reads_tokens = in.hash_layer_count > in.layer_start || m.mtp != nullptr;
#if DGR_LAYER_RANGE
    reads_tokens = reads_tokens || llama_model_stage_needs_token_ids(m.model);
#endif
    if (reads_tokens) {
        return Status(kMissingTokenIds, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") reads token ids, which media rows have none of");
    }
    if (!step.causal && n_tokens > (int32_t) m.cfg.n_ubatch) {
        return Status(kInvalidArgument, "a non-causal media step of " + std::to_string(n_tokens) +
                      " rows must fit in one chunk of n_ubatch " + std::to_string(m.cfg.n_ubatch) + " rows");
    }
    m.one_slot.assign((size_t) n_tokens, slot);
    m.media = &step;
    m.media_total = n_tokens;
    if (!step.causal) llama_set_causal_attn(m.ctx, false);
    struct Done {
        Impl & m;
        bool causal;
        ~Done() {
            if (!causal) llama_set_causal_attn(m.ctx, true);
            m.media = nullptr;
            m.media_row = m.media_total = 0;
        }
    } done{m, step.causal};
    // the first section is each row's cell position (llama.cpp's ubatch.pos[i])
    return m.ForwardBatch(m.one_slot.data(), step.pos, nullptr, step.rows, n_tokens, want, out,
                          out_capacity, n_out_rows);
}

Status Engine::Impl::Embed(int32_t slot, const int32_t * pos, const int32_t * tokens,
                           const float * boundary, int32_t n_tokens, float * out, size_t out_capacity,
                           int32_t * n_out_rows) {
    Impl & m = *this;
    *n_out_rows = 0;
    if (!m.last) {
        return Status(kInvalidArgument, "embeddings come from the last stage; this stage ends at layer " +
                      std::to_string(m.info.layer_end) + " of " + std::to_string(m.info.n_layer));
    }
    if (m.mtp || m.info.arch == "deepseek4") {
        return Status(kInvalidArgument, "this engine (" + m.info.arch + (m.mtp ? ", MTP" : "") +
                      ") does not return embeddings");
    }
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    m.embed_want.assign((size_t) n_tokens, 1);
    // on for this call only: a later forward's graph returns logits as before
    llama_set_embeddings(m.ctx, true);
    m.embed_rows = true;
    struct Off {
        Impl & m;
        ~Off() { m.embed_rows = false; llama_set_embeddings(m.ctx, false); }
    } off{m};
    return m.Forward(slot, pos, tokens, boundary, n_tokens, m.embed_want.data(), out, out_capacity,
                     n_out_rows);
}

Status Engine::Impl::ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                                  const float * boundary, int32_t n_tokens, const uint8_t * want,
                                  float * out, size_t out_capacity, int32_t * n_out_rows) {
    Impl & m = *this;
    const EngineInfo & in = m.info;
    *n_out_rows = 0;
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    if (!slots) return Status(kUnknownSlot, "a batch needs the slot of every token");
    if (!pos) return Status(kInvalidPosition, "positions are required");
    const uint32_t n_slots = m.cfg.n_slots;
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (slots[i] < 0 || (uint32_t) slots[i] >= n_slots) {
            return Status(kUnknownSlot, "slot " + std::to_string(slots[i]) + " of token " + std::to_string(i) +
                          " does not exist; this engine has slots 0.." + std::to_string(n_slots - 1));
        }
    }
    // a media step (ForwardMedia, checked there): rows on every stage, the first's included
    Status in_ok = m.media ? Status() : CheckStageInputs(tokens, boundary, n_tokens);
    if (!in_ok.ok()) return in_ok;
    // an M-RoPE media step: its rows' cell positions (the t section) need only not go back
    const bool sectioned = m.media && m.media->n_sections > 1;
    int32_t media_end = -1;  // its highest position + 1, where the slot continues
    if (sectioned) {
        for (int32_t k = 0; k < m.media->n_sections * n_tokens; ++k) media_end = std::max(media_end, pos[k] + 1);
    }

    // Each slot's tokens, in input order, continue it: the first at its next position, each
    // later one at the position after the one before it.
    std::vector<int32_t> expect(n_slots, -1);   // next position a slot's next token must have
    std::vector<int32_t> start(n_slots, -1);    // the slot's position before this batch
    std::vector<int32_t> last_idx(n_slots, -1); // the slot's last token in the batch
    std::vector<int32_t> seen;                  // the slots of the batch, in order of appearance
    for (int32_t i = 0; i < n_tokens; ++i) {
        const int32_t s = slots[i];
        if (expect[s] < 0) {
            expect[s] = start[s] = m.SlotNext(s);
            seen.push_back(s);
            if (pos[i] != expect[s]) {
                return Status(kInvalidPosition, "slot " + std::to_string(s) + " continues at position " +
                              std::to_string(expect[s]) + " but its first token in the batch (index " +
                              std::to_string(i) + ") is at " + std::to_string(pos[i]) +
                              (pos[i] > expect[s] ? " (a gap: send the missing tokens first)"
                                                  : " (already computed: release the slot and re-prefill)"));
            }
        } else if (sectioned) {
            if (pos[i] < pos[i - 1]) {
                return Status(kInvalidPosition, "a media step's positions go back at index " + std::to_string(i) +
                              " (" + std::to_string(pos[i - 1]) + " then " + std::to_string(pos[i]) + ")");
            }
            expect[s] = pos[i];
        } else if (pos[i] != expect[s]) {
            return Status(kInvalidPosition, "slot " + std::to_string(s) + " appears again at index " +
                          std::to_string(i) + " with position " + std::to_string(pos[i]) + ", but its "
                          "tokens in a batch must have consecutive positions: it should be " +
                          std::to_string(expect[s]) + (pos[i] < expect[s] ? " (a duplicate position)" : ""));
        }
        ++expect[s];
        last_idx[s] = i;
    }
    if (sectioned) expect[slots[0]] = std::max(expect[slots[0]], media_end);
    for (const int32_t s : seen) {
        if ((int64_t) expect[s] > (int64_t) in.n_ctx) {
            return Status(kContextFull, "slot " + std::to_string(s) + " holds " + std::to_string(start[s]) +
                          " tokens; " + std::to_string(expect[s] - start[s]) + " more exceed its context of " +
                          std::to_string(in.n_ctx) + " tokens (release the slot or use a larger n_ctx)");
        }
    }

    // Where each token's output row goes, in input order (-1: no row).
    const int32_t width = OutputWidth();
    std::vector<int32_t> dst((size_t) n_tokens, -1);
    int32_t rows_wanted = 0;
    for (int32_t i = 0; i < n_tokens; ++i) {
        const bool w = !m.last || (want ? want[i] != 0 : last_idx[slots[i]] == i);
        if (w) dst[i] = rows_wanted++;
    }
    if ((size_t) rows_wanted * (size_t) width > out_capacity) {
        return Status(kInvalidArgument, "output buffer holds " + std::to_string(out_capacity) + " floats, " +
                      std::to_string((size_t) rows_wanted * width) + " needed");
    }

    // The llama_batch order: by slot, a slot's tokens in input order. llama.cpp's equal split
    // takes a ubatch's slots as a run of consecutive ids in batch order, so this order lets
    // slots s, s+1, ... share one ubatch whatever order the caller listed them in.
    std::vector<int32_t> order((size_t) n_tokens);
    for (int32_t i = 0; i < n_tokens; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return slots[a] < slots[b]; });

    // a row's width: the boundary's, or on the first stage a media step's embedding rows'
    const int32_t W = m.first && m.media ? in.n_embd_inp : in.n_embd_boundary;
    const float * rows_in = boundary;
    const bool rows = !m.first || m.media;
    const int32_t U = (int32_t) m.cfg.n_ubatch;
    const bool pass_tokens = tokens && m.trunk_tokens;
    // A failure once llama_decode may have run: no slot of the batch keeps a half-computed step.
    auto clear_all = [&]() {
        for (const int32_t s : seen) m.ClearSlot(s);
    };
    auto slot_list = [&]() {
        std::string t;
        for (size_t k = 0; k < seen.size(); ++k) t += (k ? ", " : "") + std::to_string(seen[k]);
        return t;
    };
    auto cleared = [&](const std::string & why) {
        clear_all();
        return Status(kEngineError, why + "; slots " + slot_list() + " were cleared and must be re-prefilled");
    };
    int32_t rows_out = 0;
    const auto t_forward = std::chrono::steady_clock::now();
    try {
        for (int32_t c0 = 0; c0 < n_tokens; c0 += U) {
            const int32_t n = std::min(U, n_tokens - c0);
            const int32_t * idx = order.data() + c0;
            // the caller's rows are already in batch order here: read them in place
            bool in_place = true;
            for (int32_t k = 1; k < n && in_place; ++k) in_place = idx[k] == idx[0] + k;
            llama_batch & b = m.batch;
            b.n_tokens = n;
            if (pass_tokens) {
                if (in_place) {
                    b.token = const_cast<int32_t *>(tokens + idx[0]);
                } else {
                    for (int32_t k = 0; k < n; ++k) m.batch_token[k] = tokens[idx[k]];
                    b.token = m.batch_token;
                }
            } else {
                b.token = nullptr;
            }
            if (!rows) {
                b.embd = nullptr;
            } else if (in_place) {
                b.embd = const_cast<float *>(rows_in + (size_t) idx[0] * W);
            } else {
                m.embd_gather.resize((size_t) U * W);
                for (int32_t k = 0; k < n; ++k) {
                    std::memcpy(m.embd_gather.data() + (size_t) k * W, rows_in + (size_t) idx[k] * W,
                                sizeof(float) * (size_t) W);
                }
                b.embd = m.embd_gather.data();
            }
            m.media_row = c0;  // a media step is one slot's rows in order: chunk c0 is its rows c0..

            for (int32_t k = 0; k < n; ++k) {
                b.pos[k] = pos[idx[k]];
                b.seq_id[k][0] = slots[idx[k]];
                b.logits[k] = (m.last && dst[idx[k]] >= 0) ? 1 : 0;
            }
            // the ubatches llama.cpp's equal split will make of this decode: one per run of
            // consecutive slot ids holding as many tokens each (b is in slot order)
            int64_t runs = 0;
            for (int32_t k = 0, prev_s = -2, prev_n = -1; k < n;) {
                int32_t e = k + 1;
                while (e < n && b.seq_id[e][0] == b.seq_id[k][0]) ++e;
                const int32_t s = b.seq_id[k][0];
                if (s != prev_s + 1 || e - k != prev_n) ++runs;
                prev_s = s;
                prev_n = e - k;
                k = e;
            }
            const auto t_decode = std::chrono::steady_clock::now();
            const int32_t rc = m.Decode(n);
            m.counters.decode_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t_decode).count(), std::memory_order_relaxed);
            m.counters.decodes.fetch_add(1, std::memory_order_relaxed);
            m.counters.ubatches.fetch_add(runs, std::memory_order_relaxed);
            m.counters.graphs_reused.store(llama_perf_context(m.ctx).n_reused, std::memory_order_relaxed);
            if (rc != 0) {
                clear_all();
                std::string why = log_last_error();
                return Status(rc == 1 ? kContextFull : kEngineError,
                              "llama_decode failed with code " + std::to_string(rc) + " on a batch of slots " +
                              slot_list() + "; they were cleared and must be re-prefilled" +
                              (why.empty() ? "" : ": " + why));
            }
            // each slot's tokens in this decode: its rollback window (the last ubatch keeps a
            // sequence's last n_rs_seq+1 tokens together)
            for (int32_t k = 0; k < n;) {
                int32_t e = k + 1;
                while (e < n && slots[idx[e]] == slots[idx[k]]) ++e;
                m.rs_tail[slots[idx[k]]] = e - k;
                m.AfterDecode(slots[idx[k]], pos[idx[k]], e - k);
                k = e;
            }
            if (m.mtp) {
                const float * h = llama_get_embeddings_nextn(m.ctx);
                if (!h) return cleared("llama.cpp returned no hidden rows for the MTP catch-up");
                for (int32_t k = 0; k < n; ++k) m.mtp->SetRow(k, slots[idx[k]], tokens[idx[k]]);
                const int32_t mrc = m.mtp->CatchUp(b.pos, h, n);
                if (mrc != 0) {
                    std::string why = log_last_error();
                    return cleared("the MTP catch-up decode failed with code " + std::to_string(mrc) +
                                   (why.empty() ? "" : ": " + why));
                }
            }
            if (m.last) {
                for (int32_t k = 0; k < n; ++k) {
                    if (!b.logits[k]) continue;
                    const float * row = m.embed_rows ? llama_get_embeddings_ith(m.ctx, k)
                                                     : llama_get_logits_ith(m.ctx, k);
                    if (!row) {
                        return cleared(std::string("llama.cpp returned no ") +
                                       (m.embed_rows ? "embedding" : "logits") + " for row " +
                                       std::to_string(idx[k]));
                    }
                    std::memcpy(out + (size_t) dst[idx[k]] * width, row, sizeof(float) * (size_t) width);
                    ++rows_out;
                }
            } else {
#if DGR_LAYER_RANGE
                const float * bnd = llama_get_boundary(m.ctx);
                if (!bnd) return cleared("llama.cpp returned no boundary");
                if (in_place) {
                    std::memcpy(out + (size_t) idx[0] * width, bnd, sizeof(float) * (size_t) n * width);
                } else {
                    for (int32_t k = 0; k < n; ++k) {
                        std::memcpy(out + (size_t) idx[k] * width, bnd + (size_t) k * width,
                                    sizeof(float) * (size_t) width);
                    }
                }
                rows_out += n;
#else
                return Status(kUnsupportedArch, "this build of llama.cpp has no layer ranges");
#endif
            }
        }
    } catch (...) {
        m.batch.token = nullptr;
        m.batch.embd = nullptr;
        const std::string why = current_exception_text();
        clear_all();
        return Status(kEngineError, "llama.cpp threw during the forward of a batch of slots " + slot_list() +
                      " (" + why + "); they were cleared and must be re-prefilled");
    }
    if (sectioned) {
        const int32_t s = slots[0];
        m.media_next[s] = media_end > llama_memory_seq_pos_max(llama_get_memory(m.ctx), s) + 1 ? media_end : -1;
    } else {
        for (const int32_t s : seen) m.media_next[s] = -1;  // the slot's cells are past it now
    }
    *n_out_rows = rows_out;
    m.counters.forwards.fetch_add(1, std::memory_order_relaxed);
    m.counters.forward_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t_forward).count(), std::memory_order_relaxed);
    return Status();
}

}  // namespace dgr
