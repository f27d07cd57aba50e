// A slot's caches: released, copied, truncated (the rollback rules of each memory type).

#include <algorithm>

#include "impl.h"

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
    return Status();
}

void Engine::Impl::ClearSlot(int32_t slot) {
    Impl & m = *this;
    llama_memory_seq_rm(llama_get_memory(m.ctx), slot, -1, -1);
    m.rs_tail[slot] = 0;
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
    const int32_t next = llama_memory_seq_pos_max(mem, slot) + 1;
    if (pos >= next) return Status();  // nothing past pos
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
            return refuse(m.info.arch + "'s recurrent state keeps no history of its positions");
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
