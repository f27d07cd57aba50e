// A slot's caches: released, copied, truncated (the rollback rules of each memory type).

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "impl.h"
#include "llama-io.h"
#include "llama-memory-recurrent.h"

namespace dgr {
using namespace detail;

Status Engine::Impl::Release(int32_t slot) {
    Impl & m = *this;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    m.ClearSlot(slot);
    return Status();
}

Status Engine::Impl::CopySlot(int32_t src, int32_t dst) {
    Impl & m = *this;
    for (const int32_t s : {src, dst}) {
        if (s < 0 || (uint32_t) s >= m.cfg.n_slots) {
            return Status(kUnknownSlot, "slot " + std::to_string(s) + " does not exist; this engine has slots 0.." +
                          std::to_string(m.cfg.n_slots - 1));
        }
    }
    if (src == dst) return Status(kInvalidArgument, "a slot is not copied onto itself");
    if (m.mtp || m.info.arch == "deepseek4") {
        return Status(kInvalidArgument, "this engine (" + m.info.arch + (m.mtp ? ", MTP" : "") +
                      ") does not copy a slot's caches");
    }
    llama_memory_t mem = llama_get_memory(m.ctx);
    m.ClearSlot(dst);
    // one KV stream per slot (kv_unified=false): llama.cpp copies the whole stream's buffers
    // at the start of the next decode (llama_kv_cache::seq_cp, update), the bytes as they are
    llama_memory_seq_cp(mem, src, dst, -1, -1);
    m.rs_tail[dst] = m.rs_tail[src];
    m.media_next[dst] = m.media_next[src];
    if (m.n_snapshots) m.slot_state[dst] = m.slot_state[src];  // a fork restores as its source
    return Status();
}

int32_t Engine::Impl::SlotNext(int32_t slot) const {
    return std::max(llama_memory_seq_pos_max(llama_get_memory(ctx), slot) + 1, media_next[slot]);
}

void Engine::Impl::ClearSlot(int32_t slot) {
    Impl & m = *this;
    llama_memory_seq_rm(llama_get_memory(m.ctx), slot, -1, -1);
    m.rs_tail[slot] = 0;
    m.media_next[slot] = -1;
    if (m.n_snapshots) {
        m.slot_state[slot].aligned = 0;
        m.slot_state[slot].snaps.clear();
    }
    if (m.mtp) m.mtp->Clear(slot);
}

Status Engine::Impl::Truncate(int32_t slot, int32_t pos) {
    Impl & m = *this;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (pos < 0) return Status(kInvalidPosition, "truncate position " + std::to_string(pos) + " is negative");
    llama_memory_t mem = llama_get_memory(m.ctx);
    if (pos >= m.SlotNext(slot)) return Status();  // nothing past pos
    if (m.media_next[slot] > pos) m.media_next[slot] = -1;  // back into a media step's span
    const int32_t next = llama_memory_seq_pos_max(mem, slot) + 1;
    if (pos >= next) return Status();  // past the media step's cells: they stay
    const std::string span = "positions " + std::to_string(pos) + ".." + std::to_string(next - 1) + " of slot " +
                             std::to_string(slot);
    auto refuse = [&](const std::string & why) {
        m.ClearSlot(slot);
        return Status(kRollbackUnsupported, "this stage cannot drop " + span + ": " + why +
                      "; the slot was cleared: re-prefill");
    };
    if (pos == 0) {  // the whole sequence: always possible
        m.ClearSlot(slot);
        return Status();
    }
    const int32_t drop = next - pos;
    if (m.rs_window >= 0 && drop > std::min(m.rs_window, m.rs_tail[slot])) {
        // The snapshots are of the slot's tokens in the last ubatch: past them (or after a
        // truncate with no forward since) llama.cpp's seq_rm would accept a rollback it cannot
        // restore exactly.
        if (m.rs_window == 0) {
            if (m.RestoreSnapshot(slot, pos)) return Status();
            if (!m.n_snapshots) {
                return refuse(m.info.arch + "'s recurrent state keeps no history of its positions, and this "
                              "engine keeps no state snapshots (state_snapshots=0)");
            }
            std::string at;
            for (const auto & s : m.slot_state[slot].snaps) at += (at.empty() ? "" : ", ") + std::to_string(s.pos);
            return refuse(m.info.arch + "'s recurrent state keeps no history of its positions, and the slot "
                          "keeps state snapshots only at the ends of whole chunks of " +
                          std::to_string(m.cfg.n_ubatch) + " prefilled from position 0 (" +
                          (at.empty() ? std::string("none yet") : "at " + at) + ")");
        }
        return refuse(m.info.arch + "'s compressed state rolls back at most " + std::to_string(m.rs_window) +
                      " positions, and only of the slot's last forward (" + std::to_string(m.rs_tail[slot]) +
                      " positions since its last forward or truncate)");
    }
    if (m.mtp) {
        const std::string why = m.mtp->CannotTruncate(slot, pos);
        if (!why.empty()) return refuse(why);
    }
    if (!llama_memory_seq_rm(mem, slot, pos, -1)) {
        return refuse("the " + m.info.arch + " cache refuses this partial removal");
    }
    m.rs_tail[slot] = 0;
    if (m.mtp && !m.mtp->Truncate(slot, pos)) {
        return refuse("the MTP cache refuses this partial removal");
    }
    return Status();
}

Status Engine::Impl::MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out) {
    Impl & m = *this;
    out->clear();
    if (!m.mtp) {
        return Status(kMtpNotSupported, "this engine was loaded without mtp: load the last stage with mtp=True "
                      "to draft with its NextN block");
    }
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (token < 0 || token >= m.info.n_vocab) {
        return Status(kInvalidToken, "token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                      std::to_string(m.info.n_vocab) + ")");
    }
    if (n_max < 0) return Status(kInvalidArgument, "n_max must be >= 0, got " + std::to_string(n_max));
    const int32_t pos0 = llama_memory_seq_pos_max(llama_get_memory(m.ctx), slot) + 1;
    if (pos0 == 0) {
        return Status(kInvalidPosition, "slot " + std::to_string(slot) + " holds no positions: forward the prompt "
                      "before drafting from it");
    }
    // the verifying step (token + drafts) must fit in the slot's context
    const int32_t n = (int32_t) std::max<int64_t>(0, std::min<int64_t>(n_max, (int64_t) m.info.n_ctx - pos0 - 1));
    if (n == 0) return Status();
    bool stuck = false;
    Status st = m.mtp->Draft(slot, pos0, token, n, out, &stuck);
    if (stuck) m.ClearSlot(slot);  // the MTP cache kept a draft it could not drop
    return st;
}

}  // namespace dgr

namespace dgr {

namespace {

// A recurrent memory's rows of one sequence, written to and read from a host buffer
// (Impl::snap_recr): llama.cpp's own host io classes are private to llama-context.cpp.
struct SnapWriter : llama_io_write_i {
    std::vector<uint8_t> & out;
    explicit SnapWriter(std::vector<uint8_t> & o) : out(o) { out.clear(); }
    void write(const void * src, size_t size) override {
        const uint8_t * p = (const uint8_t *) src;
        out.insert(out.end(), p, p + size);
    }
    void write_tensor(ggml_tensor * t, size_t offset, size_t size) override {
        const size_t at = out.size();
        out.resize(at + size);
        ggml_backend_tensor_get(t, out.data() + at, offset, size);
    }
    size_t n_bytes() override { return out.size(); }
};

struct SnapReader : llama_io_read_i {
    const std::vector<uint8_t> & in;
    size_t at = 0;
    explicit SnapReader(const std::vector<uint8_t> & i) : in(i) {}
    const uint8_t * take(size_t size) {
        if (size > in.size() - at) throw std::runtime_error("state snapshot too short");
        const uint8_t * p = in.data() + at;
        at += size;
        return p;
    }
    void read(void * dst, size_t size) override { std::memcpy(dst, take(size), size); }
    void read_tensor(ggml_tensor * t, size_t offset, size_t size) override {
        ggml_backend_tensor_set(t, take(size), offset, size);
    }
    size_t n_bytes() override { return at; }
};

}  // namespace

bool Engine::Impl::WriteSnapshot(int32_t slot, std::vector<uint8_t> & data) {
    const llama_state_seq_flags fl = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    if (snap_recr) {
        llama_synchronize(ctx);
        try {
            SnapWriter io(data);
            snap_recr->state_write(io, slot, fl);
        } catch (const std::exception &) {
            return false;
        }
        return true;
    }
    data.resize(llama_state_seq_get_size_ext(ctx, slot, fl));
    return llama_state_seq_get_data_ext(ctx, data.data(), data.size(), slot, fl) == data.size();
}

bool Engine::Impl::ReadSnapshot(int32_t slot, const std::vector<uint8_t> & data) {
    const llama_state_seq_flags fl = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    if (snap_recr) {
        llama_synchronize(ctx);
        try {
            SnapReader io(data);
            snap_recr->state_read(io, slot, fl);
            return io.n_bytes() == data.size();
        } catch (const std::exception &) {
            return false;
        }
    }
    return llama_state_seq_set_data_ext(ctx, data.data(), data.size(), slot, fl) == data.size();
}

void Engine::Impl::AfterDecode(int32_t slot, int32_t first, int32_t count) {
    if (!n_snapshots) return;
    SlotState & ss = slot_state[slot];
    if (ss.aligned < 0) return;
    if (count != (int32_t) cfg.n_ubatch || first != ss.aligned) {
        ss.aligned = -1;  // a partial chunk or a decode step: its state is not a fresh prefill's
        return;
    }
    ss.aligned = first + count;
    Snapshot snap;
    if (ss.snaps.size() >= n_snapshots) {  // the oldest goes; its buffer is reused
        snap.data = std::move(ss.snaps.front().data);
        ss.snaps.pop_front();
    }
    snap.pos = ss.aligned;
    if (!WriteSnapshot(slot, snap.data)) {
        ss.aligned = -1;  // not taken: no later snapshot either (they must be a contiguous run)
        return;
    }
    ss.snaps.push_back(std::move(snap));
}

bool Engine::Impl::RestoreSnapshot(int32_t slot, int32_t pos) {
    if (!n_snapshots) return false;
    SlotState & ss = slot_state[slot];
    auto it = std::find_if(ss.snaps.begin(), ss.snaps.end(), [&](const Snapshot & s) { return s.pos == pos; });
    if (it == ss.snaps.end()) return false;
    // the recurrent rows as they were at `pos`, then the attention cells from `pos` on
    // dropped: the caches of a slot that computed 0..pos-1
    if (!ReadSnapshot(slot, it->data)) {
        ClearSlot(slot);  // a failed read leaves the state cleared (llama_memory_recurrent::state_read)
        return false;
    }
    llama_memory_t mem = llama_get_memory(ctx);
    if (!llama_memory_seq_rm(mem, slot, pos, -1) || llama_memory_seq_pos_max(mem, slot) + 1 != pos) {
        ClearSlot(slot);
        return false;
    }
    ss.snaps.erase(it + 1, ss.snaps.end());
    ss.aligned = pos;
    rs_tail[slot] = 0;
    return true;
}

}  // namespace dgr
