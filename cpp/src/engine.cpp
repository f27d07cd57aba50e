// dgr::Engine over the patched llama.cpp: range load, slot-keyed forward, typed status.
// The public methods, each run through guarded(); their bodies are in cpp/src/engine/
// (impl.h lists which file holds which concern).

#include "dgr/engine.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "engine/impl.h"

namespace dgr {
using namespace detail;

Engine::Engine() : impl_(new Impl) {}
Engine::~Engine() = default;

const EngineInfo & Engine::info() const noexcept { return impl_->info; }
bool Engine::is_first() const noexcept { return impl_->first; }
bool Engine::is_last() const noexcept { return impl_->last; }
int32_t Engine::OutputWidth() const noexcept { return impl_->OutputWidth(); }

Status Engine::Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out) {
    return guarded("loading the model", [&] { return Impl::Load(cfg, out); });
}

Status Engine::RefreshMemory() {
    return guarded("reading the memory figures", [&] { return impl_->RefreshMemory(); });
}

Status Engine::Tokenize(const std::string & text, bool add_special, bool parse_special,
                        std::vector<int32_t> * out) const {
    return guarded("tokenize", [&] { return impl_->Tokenize(text, add_special, parse_special, out); });
}

Status Engine::Detokenize(const int32_t * tokens, size_t n, bool remove_special, bool unparse_special,
                          std::string * out) const {
    return guarded("detokenize", [&] {
        return impl_->Detokenize(tokens, n, remove_special, unparse_special, out);
    });
}

Status Engine::Forward(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                       int32_t n_tokens, const uint8_t * want, float * out, size_t out_capacity,
                       int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();  // a failure's message quotes this call's log lines, not an earlier one's
    return impl_->Checked(guarded("forward", [&] {
        return impl_->Forward(slot, pos, tokens, boundary, n_tokens, want, out, out_capacity, n_out_rows);
    }));
}

Status Engine::ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                            const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                            size_t out_capacity, int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();
    return impl_->Checked(guarded("forward_batch", [&] {
        return impl_->ForwardBatch(slots, pos, tokens, boundary, n_tokens, want, out, out_capacity,
                                   n_out_rows);
    }));
}

Status Engine::ForwardMedia(int32_t slot, const MediaStep & step, int32_t n_tokens, const uint8_t * want,
                            float * out, size_t out_capacity, int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();
    return impl_->Checked(guarded("forward_media", [&] {
        return impl_->ForwardMedia(slot, step, n_tokens, want, out, out_capacity, n_out_rows);
    }));
}

Status Engine::Embed(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                     int32_t n_tokens, float * out, size_t out_capacity, int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();
    return impl_->Checked(guarded("embed", [&] {
        return impl_->Embed(slot, pos, tokens, boundary, n_tokens, out, out_capacity, n_out_rows);
    }));
}

Status Engine::Release(int32_t slot) {
    return guarded("release", [&] { return impl_->Release(slot); });
}

Status Engine::CopySlot(int32_t src, int32_t dst) {
    if (impl_->lost) return impl_->Refuse();
    return guarded("copy_slot", [&] { return impl_->CopySlot(src, dst); });
}

Status Engine::Truncate(int32_t slot, int32_t pos) {
    if (impl_->lost) return impl_->Refuse();
    return impl_->Checked(guarded("truncate", [&] { return impl_->Truncate(slot, pos); }));
}

Status Engine::MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out) {
    out->clear();
    if (impl_->lost) return impl_->Refuse();
    return impl_->Checked(guarded("mtp_draft", [&] { return impl_->MtpDraft(slot, token, n_max, out); }));
}

Status Engine::InjectFault(const std::string & what) {
    if (what == "device_lost") {
        impl_->MarkLost();
        return Status();
    }
    if (what == "device_lost_in_decode") {
        impl_->throw_in_decode = "vk::Queue::submit: ErrorDeviceLost (injected)";
        return Status();
    }
    return Status(kInvalidArgument, "unknown fault '" + what + "' (known: device_lost, "
                  "device_lost_in_decode)");
}

Status Engine::Impl::Tokenize(const std::string & text, bool add_special, bool parse_special,
                              std::vector<int32_t> * out) const {
    const Impl & m = *this;
    if (text.size() > (size_t) INT32_MAX / 2) return Status(kInvalidArgument, "text too long to tokenize");
    out->resize(text.size() + 8);
    int32_t n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), out->data(),
                               (int32_t) out->size(), add_special, parse_special);
    if (n < 0) {
        if (n == INT32_MIN) return Status(kInvalidArgument, "tokenization overflowed int32");
        out->resize((size_t) -n);
        n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), out->data(),
                           (int32_t) out->size(), add_special, parse_special);
        if (n < 0) return Status(kEngineError, "tokenization failed");
    }
    out->resize((size_t) n);
    return Status();
}

Status Engine::Impl::Detokenize(const int32_t * tokens, size_t n, bool remove_special,
                                bool unparse_special, std::string * out) const {
    const Impl & m = *this;
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= m.info.n_vocab) {
            return Status(kInvalidToken, "token id " + std::to_string(tokens[i]) + " at index " +
                          std::to_string(i) + " is outside the vocabulary [0, " +
                          std::to_string(m.info.n_vocab) + ")");
        }
    }
    out->resize(n * 8 + 16);
    int32_t k = llama_detokenize(m.vocab, tokens, (int32_t) n, out->data(), (int32_t) out->size(),
                                 remove_special, unparse_special);
    if (k < 0) {
        out->resize((size_t) -k);
        k = llama_detokenize(m.vocab, tokens, (int32_t) n, out->data(), (int32_t) out->size(),
                             remove_special, unparse_special);
        if (k < 0) return Status(kEngineError, "detokenization failed");
    }
    out->resize((size_t) k);
    return Status();
}

Status Engine::TokenPieces(int32_t first, int32_t count, bool special, std::string * bytes,
                           std::vector<int32_t> * ends) const {
    return guarded("token_pieces", [&]() -> Status {
        const int32_t n_vocab = impl_->info.n_vocab;
        if (first < 0 || count < 0) {
            return Status(kInvalidArgument, "token_pieces needs first >= 0 and count >= 0, got " +
                          std::to_string(first) + " and " + std::to_string(count));
        }
        const int32_t last = (int32_t) std::min<int64_t>((int64_t) first + count, n_vocab);
        bytes->clear();
        ends->clear();
        char buf[256];
        for (int32_t t = first; t < last; ++t) {
            int32_t k = llama_token_to_piece(impl_->vocab, t, buf, (int32_t) sizeof buf, 0, special);
            if (k < 0) {
                std::string big((size_t) -k, '\0');
                k = llama_token_to_piece(impl_->vocab, t, big.data(), (int32_t) big.size(), 0, special);
                if (k < 0) return Status(kEngineError, "token_to_piece failed for " + std::to_string(t));
                bytes->append(big.data(), (size_t) k);
            } else {
                bytes->append(buf, (size_t) k);
            }
            if (bytes->size() > (size_t) INT32_MAX) return Status(kInvalidArgument, "pieces too long");
            ends->push_back((int32_t) bytes->size());
        }
        return Status();
    });
}

bool Engine::IsEog(int32_t token) const {
    return token >= 0 && token < impl_->info.n_vocab && llama_vocab_is_eog(impl_->vocab, token);
}

int64_t Engine::GraphsReused() const {
    return impl_->ctx ? llama_perf_context(impl_->ctx).n_reused : 0;
}

Engine::Counters Engine::GetCounters() const {
    const auto & c = impl_->counters;
    Counters out;
    out.forwards = c.forwards.load(std::memory_order_relaxed);
    out.decodes = c.decodes.load(std::memory_order_relaxed);
    out.ubatches = c.ubatches.load(std::memory_order_relaxed);
    out.forward_ns = c.forward_ns.load(std::memory_order_relaxed);
    out.decode_ns = c.decode_ns.load(std::memory_order_relaxed);
    out.graphs_reused = c.graphs_reused.load(std::memory_order_relaxed);
    return out;
}

std::vector<int32_t> Engine::StateSnapshots(int32_t slot) const {
    std::vector<int32_t> out;
    const Impl & m = *impl_;
    if (slot < 0 || (uint32_t) slot >= m.slot_state.size()) return out;
    for (const auto & s : m.slot_state[slot].snaps) out.push_back(s.pos);
    return out;
}

uint64_t Engine::StateSnapshotBytes() const {
    uint64_t b = 0;
    for (const auto & ss : impl_->slot_state) {
        for (const auto & s : ss.snaps) b += s.data.size();
    }
    return b;
}

int32_t Engine::NextPos(int32_t slot) const {
    const Impl & m = *impl_;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) return -1;
    return m.SlotNext(slot);
}

}  // namespace dgr
