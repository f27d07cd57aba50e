// dgr wire frames: decode + validate and encode (see cpp/include/dgr/frame.h, docs/wire.md).
// Mirrors dgr/protocol/wire.py rule by rule; the order of the checks is part of the contract
// (the error code a bad frame gets), so keep both sides in step.
#include "dgr/frame.h"

#include <cfloat>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <string>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

namespace dgr {
namespace wire {

static inline uint64_t xxh3(const void* data, size_t size) noexcept;

namespace {

constexpr int64_t kI32Max = 2147483647;
constexpr uint64_t kI64Max = 9223372036854775807ull;

// --- msgpack reading ---------------------------------------------------------------

// An integer as msgpack carries it: any width, signed or not.
struct Int {
    bool neg = false;  // true: value < 0, held in `s`
    uint64_t u = 0;    // value >= 0
    int64_t s = 0;
};

class Reader {
public:
    Reader(const uint8_t* p, const uint8_t* end) : p_(p), end_(end) {}

    bool at_end() const { return p_ == end_; }
    bool peek(uint8_t* b) const {
        if (p_ >= end_) return false;
        *b = *p_;
        return true;
    }

    bool nil() {  // consumes a nil if there is one
        if (p_ < end_ && *p_ == 0xc0) {
            ++p_;
            return true;
        }
        return false;
    }

    bool read_int(Int* v) {
        uint8_t b;
        if (!peek(&b)) return false;
        if (b <= 0x7f) { ++p_; v->neg = false; v->u = b; return true; }
        if (b >= 0xe0) { ++p_; v->neg = true; v->s = static_cast<int8_t>(b); return true; }
        uint64_t raw;
        switch (b) {
            case 0xcc: if (!be(1, &raw)) return false; v->neg = false; v->u = raw; return true;
            case 0xcd: if (!be(2, &raw)) return false; v->neg = false; v->u = raw; return true;
            case 0xce: if (!be(4, &raw)) return false; v->neg = false; v->u = raw; return true;
            case 0xcf: if (!be(8, &raw)) return false; v->neg = false; v->u = raw; return true;
            case 0xd0: return be(1, &raw) && set_signed(static_cast<int8_t>(raw), v);
            case 0xd1: return be(2, &raw) && set_signed(static_cast<int16_t>(raw), v);
            case 0xd2: return be(4, &raw) && set_signed(static_cast<int32_t>(raw), v);
            case 0xd3: return be(8, &raw) && set_signed(static_cast<int64_t>(raw), v);
            default: return false;
        }
    }

    // An int in [lo, hi] (hi <= 2^64 - 1, lo >= 0).
    bool read_uint_in(uint64_t lo, uint64_t hi, uint64_t* out) {
        Int v;
        if (!read_int(&v) || v.neg || v.u < lo || v.u > hi) return false;
        *out = v.u;
        return true;
    }
    bool read_i32(int64_t lo, int32_t* out) {  // an int in [lo, 2^31 - 1]
        uint64_t u;
        if (!read_uint_in(static_cast<uint64_t>(lo), kI32Max, &u)) return false;
        *out = static_cast<int32_t>(u);
        return true;
    }
    bool read_i64(int64_t* out) {  // an int in [0, 2^63 - 1]
        uint64_t u;
        if (!read_uint_in(0, kI64Max, &u)) return false;
        *out = static_cast<int64_t>(u);
        return true;
    }

    // A float field: msgpack float32/float64, or any int (converted as msgspec does).
    bool read_float(double* out) {
        uint8_t b;
        if (!peek(&b)) return false;
        uint64_t raw;
        if (b == 0xca) {
            if (!be(4, &raw)) return false;
            uint32_t bits = static_cast<uint32_t>(raw);
            float f;
            std::memcpy(&f, &bits, 4);
            *out = f;
            return true;
        }
        if (b == 0xcb) {
            if (!be(8, &raw)) return false;
            std::memcpy(out, &raw, 8);
            return true;
        }
        Int v;
        if (!read_int(&v)) return false;
        *out = v.neg ? static_cast<double>(v.s) : static_cast<double>(v.u);
        return true;
    }

    bool read_bool(bool* out) {
        uint8_t b;
        if (!peek(&b) || (b != 0xc2 && b != 0xc3)) return false;
        ++p_;
        *out = b == 0xc3;
        return true;
    }

    bool read_str(std::string_view* out) {
        uint8_t b;
        if (!peek(&b)) return false;
        uint64_t n;
        if (b >= 0xa0 && b <= 0xbf) {
            ++p_;
            n = b & 0x1f;
        } else if (b == 0xd9) {
            if (!be(1, &n)) return false;
        } else if (b == 0xda) {
            if (!be(2, &n)) return false;
        } else if (b == 0xdb) {
            if (!be(4, &n)) return false;
        } else {
            return false;
        }
        if (n > static_cast<uint64_t>(end_ - p_)) return false;
        const char* s = reinterpret_cast<const char*>(p_);
        if (!valid_utf8(p_, static_cast<size_t>(n))) return false;
        *out = std::string_view(s, static_cast<size_t>(n));
        p_ += n;
        return true;
    }

    // An array header (fixarray, array16, array32): its length.
    bool read_array(uint64_t* n) {
        uint8_t b;
        if (!peek(&b)) return false;
        if (b >= 0x90 && b <= 0x9f) {
            ++p_;
            *n = b & 0x0f;
            return true;
        }
        if (b == 0xdc) return be(2, n);
        if (b == 0xdd) return be(4, n);
        return false;
    }

    // Skip `count` whole values of any type (unknown trailing items), without recursion.
    bool skip(uint64_t count) {
        while (count) {
            --count;
            uint8_t b;
            if (!peek(&b)) return false;
            ++p_;
            uint64_t n = 0;
            if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) continue;
            if (b >= 0x80 && b <= 0x8f) { count += 2ull * (b & 0x0f); continue; }
            if (b >= 0x90 && b <= 0x9f) { count += b & 0x0f; continue; }
            if (b >= 0xa0 && b <= 0xbf) { if (!advance(b & 0x1f)) return false; continue; }
            switch (b) {
                case 0xc4: case 0xd9: if (!len(1, &n) || !advance(n)) return false; break;
                case 0xc5: case 0xda: if (!len(2, &n) || !advance(n)) return false; break;
                case 0xc6: case 0xdb: if (!len(4, &n) || !advance(n)) return false; break;
                case 0xc7: if (!len(1, &n) || !advance(n + 1)) return false; break;
                case 0xc8: if (!len(2, &n) || !advance(n + 1)) return false; break;
                case 0xc9: if (!len(4, &n) || !advance(n + 1)) return false; break;
                case 0xca: case 0xce: case 0xd2: if (!advance(4)) return false; break;
                case 0xcb: case 0xcf: case 0xd3: if (!advance(8)) return false; break;
                case 0xcc: case 0xd0: if (!advance(1)) return false; break;
                case 0xcd: case 0xd1: if (!advance(2)) return false; break;
                case 0xd4: if (!advance(2)) return false; break;
                case 0xd5: if (!advance(3)) return false; break;
                case 0xd6: if (!advance(5)) return false; break;
                case 0xd7: if (!advance(9)) return false; break;
                case 0xd8: if (!advance(17)) return false; break;
                case 0xdc: if (!len(2, &n)) return false; count += n; break;
                case 0xdd: if (!len(4, &n)) return false; count += n; break;
                case 0xde: if (!len(2, &n)) return false; count += 2 * n; break;
                case 0xdf: if (!len(4, &n)) return false; count += 2 * n; break;
                default: return false;  // 0xc1: never used
            }
        }
        return true;
    }

    // nil, or an array of ints in [0, 2^31 - 1].
    bool read_i32_list(bool* has, std::vector<int32_t>* out) {
        out->clear();
        if (nil()) {
            *has = false;
            return true;
        }
        uint64_t n;
        // each item takes at least a byte: a longer claim is truncated (and reserves nothing)
        if (!read_array(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
        *has = true;
        out->reserve(static_cast<size_t>(n));
        for (uint64_t i = 0; i < n; ++i) {
            int32_t v;
            if (!read_i32(0, &v)) return false;
            out->push_back(v);
        }
        return true;
    }

private:
    // A big-endian unsigned of `n` bytes after the type byte at p_ (consumes both).
    bool be(int n, uint64_t* out) {
        if (end_ - p_ < 1 + n) return false;
        uint64_t v = 0;
        for (int i = 1; i <= n; ++i) v = (v << 8) | p_[i];
        p_ += 1 + n;
        *out = v;
        return true;
    }
    bool len(int n, uint64_t* out) {  // like be(), the type byte already consumed
        if (end_ - p_ < n) return false;
        uint64_t v = 0;
        for (int i = 0; i < n; ++i) v = (v << 8) | p_[i];
        p_ += n;
        *out = v;
        return true;
    }
    bool advance(uint64_t n) {
        if (n > static_cast<uint64_t>(end_ - p_)) return false;
        p_ += n;
        return true;
    }
    static bool set_signed(int64_t x, Int* v) {
        if (x < 0) {
            v->neg = true;
            v->s = x;
        } else {
            v->neg = false;
            v->u = static_cast<uint64_t>(x);
        }
        return true;
    }
    // Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF), as msgspec checks.
    static bool valid_utf8(const uint8_t* s, size_t n) {
        size_t i = 0;
        while (i < n) {
            uint8_t c = s[i];
            if (c < 0x80) { ++i; continue; }
            size_t k;
            uint32_t cp;
            if ((c & 0xe0) == 0xc0) { k = 1; cp = c & 0x1f; }
            else if ((c & 0xf0) == 0xe0) { k = 2; cp = c & 0x0f; }
            else if ((c & 0xf8) == 0xf0) { k = 3; cp = c & 0x07; }
            else return false;
            if (n - i <= k) return false;
            for (size_t j = 1; j <= k; ++j) {
                uint8_t d = s[i + j];
                if ((d & 0xc0) != 0x80) return false;
                cp = (cp << 6) | (d & 0x3f);
            }
            if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000))
                return false;  // overlong
            if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
            i += k + 1;
        }
        return true;
    }

    const uint8_t* p_;
    const uint8_t* end_;
};

// --- header structs (docs/wire.md, "Header") ---------------------------------------
// Each reads the fields after the tag: `n` items are there; `need` of them are required.

bool read_sampling(Reader& r, Sampling* s) {
    uint64_t n;
    if (!r.read_array(&n)) return false;
    *s = Sampling{};
    if (n > 0) { if (!r.read_float(&s->temperature) || !(s->temperature >= 0.0)) return false; }
    if (n > 1) { if (!r.read_i32(0, &s->top_k)) return false; }
    if (n > 2) {
        if (!r.read_float(&s->top_p) || !(s->top_p > 0.0) || !(s->top_p <= 1.0)) return false;
    }
    if (n > 3) { if (!r.read_uint_in(0, UINT64_MAX, &s->seed)) return false; }
    if (n > 4) { if (!r.read_bool(&s->greedy)) return false; }
    if (n > 5) {
        if (!r.read_float(&s->min_p) || !(s->min_p >= 0.0) || !(s->min_p <= 1.0)) return false;
    }
    bool has = false;
    if (n > 6) { if (!r.read_i32_list(&has, &s->bias_ids) || !has) return false; }
    if (n > 7) {
        uint64_t m;
        if (!r.read_array(&m) || m != s->bias_ids.size()) return false;
        s->bias.resize(static_cast<size_t>(m));
        for (uint64_t i = 0; i < m; ++i) {
            if (!r.read_float(&s->bias[i]) || !(s->bias[i] <= DBL_MAX)) return false;  // -inf bans
        }
    } else if (!s->bias_ids.empty()) {
        return false;  // ids without their values
    }
    if (n > 8) { if (!r.read_i32(0, &s->penalty_last_n)) return false; }
    if (n > 9) {
        if (!r.read_float(&s->repeat_penalty) || !(s->repeat_penalty > 0.0) ||
            !std::isfinite(s->repeat_penalty)) return false;
    }
    if (n > 10) {
        if (!r.read_float(&s->frequency_penalty) || !std::isfinite(s->frequency_penalty)) return false;
    }
    if (n > 11) {
        if (!r.read_float(&s->presence_penalty) || !std::isfinite(s->presence_penalty)) return false;
    }
    if (n > 12) { if (!r.read_str(&s->grammar)) return false; }
    if (n > 13) { if (!r.read_uint_in(0, UINT64_MAX, &s->grammar_id)) return false; }
    if (n > 14) { if (!r.read_i32(0, &s->grammar_from)) return false; }
    return n <= 15 || r.skip(n - 15);
}

bool read_hops(Reader& r, bool* has, std::vector<Hop>* out) {
    out->clear();
    if (r.nil()) {
        *has = false;
        return true;
    }
    uint64_t n;
    if (!r.read_array(&n)) return false;
    *has = true;
    for (uint64_t i = 0; i < n; ++i) {
        uint64_t m;
        if (!r.read_array(&m) || m < 1) return false;
        Hop h;
        if (!r.read_str(&h.endpoint)) return false;
        if (m > 1 && !r.read_bool(&h.tokens)) return false;
        if (m > 2 && !r.skip(m - 2)) return false;
        out->push_back(h);
    }
    return true;
}

#define F(i, expr) if (n > (i) && !(expr)) return false

bool read_forward(Reader& r, uint64_t n, Forward* h) {
    h->reset();
    if (n < 7) return false;  // schema comes first: model .. layer (items 2-7) are required
    F(0, r.read_uint_in(1, UINT64_MAX, &h->schema));
    F(1, r.read_str(&h->model));
    F(2, r.read_str(&h->session));
    F(3, r.read_i64(&h->epoch));
    F(4, r.read_i32(0, &h->first_pos));
    F(5, r.read_i32(1, &h->n_tokens));
    F(6, r.read_i32(0, &h->layer));
    F(7, r.read_i32(0, &h->width));
    F(8, r.read_i32(1, &h->reserved));
    F(9, r.read_str(&h->dtype));
    F(10, r.read_str(&h->codec));
    F(11, r.read_str(&h->compression));
    F(12, r.read_i64(&h->payload_len));
    F(13, r.read_uint_in(0, UINT64_MAX, &h->checksum));
    F(14, r.read_i32_list(&h->has_positions, &h->positions));
    F(15, r.read_i32_list(&h->has_tokens, &h->tokens));
    F(16, r.read_str(&h->want));
    F(17, r.read_i32_list(&h->has_rows, &h->rows));
    if (n > 18) {
        if (r.nil()) h->has_sampling = false;
        else if (read_sampling(r, &h->sampling)) h->has_sampling = true;
        else return false;
    }
    F(19, read_hops(r, &h->has_relay, &h->relay));
    F(20, r.read_str(&h->reply_to));
    F(21, read_hops(r, &h->has_loop, &h->loop));
    F(22, r.read_i32(0, &h->steps));
    F(23, r.read_i32_list(&h->has_stop_tokens, &h->stop_tokens));
    F(24, r.read_bool(&h->solo));
    F(25, r.read_i32(0, &h->rollback));  // schema 4: speculative decoding
    F(26, r.read_i32(0, &h->drafts));
    F(27, r.read_str(&h->speculate));
    F(28, r.read_i32(0, &h->max_draft));
    F(29, r.read_str(&h->media));  // schema 6: media steps
    F(30, r.read_i32_list(&h->has_sections, &h->sections));
    F(31, r.read_bool(&h->causal));
    return n <= 32 || r.skip(n - 32);
}

bool read_result(Reader& r, uint64_t n, Result* h) {
    h->reset();
    if (n < 5) return false;  // schema, then session .. n_tokens (required)
    F(0, r.read_uint_in(1, UINT64_MAX, &h->schema));
    F(1, r.read_str(&h->session));
    F(2, r.read_i64(&h->epoch));
    F(3, r.read_i32(0, &h->first_pos));
    F(4, r.read_i32(0, &h->n_tokens));
    F(5, r.read_str(&h->kind));
    F(6, r.read_i32(0, &h->layer));
    F(7, r.read_i32(0, &h->rows));
    F(8, r.read_i32(0, &h->cols));
    F(9, r.read_i32(1, &h->reserved));
    F(10, r.read_str(&h->dtype));
    F(11, r.read_str(&h->codec));
    F(12, r.read_str(&h->compression));
    F(13, r.read_i64(&h->payload_len));
    F(14, r.read_uint_in(0, UINT64_MAX, &h->checksum));
    F(15, r.read_i32_list(&h->has_tokens, &h->tokens));
    F(16, r.read_i32(0, &h->drafted));  // schema 4
    return n <= 17 || r.skip(n - 17);
}

bool read_error(Reader& r, uint64_t n, ErrorReply* h) {
    *h = ErrorReply{};
    if (n < 3) return false;  // code, message
    F(0, r.read_uint_in(1, UINT64_MAX, &h->schema));
    F(1, r.read_i32(0, &h->code));
    F(2, r.read_str(&h->message));
    F(3, r.read_str(&h->session));
    F(4, r.read_i64(&h->epoch));
    if (n > 5) {
        if (r.nil()) h->has_retry_after = false;
        else if (r.read_float(&h->retry_after) && h->retry_after >= 0.0) h->has_retry_after = true;
        else return false;
    }
    return n <= 6 || r.skip(n - 6);
}

bool read_hello(Reader& r, uint64_t n, Hello* h) {
    *h = Hello{};
    F(0, r.read_uint_in(1, UINT64_MAX, &h->schema));
    F(1, r.read_str(&h->route));
    return n <= 2 || r.skip(n - 2);
}

#undef F

// --- cross-field rules (wire._check_forward / _check_result) ------------------------

bool is_want(std::string_view w) {
    return w == "boundary" || w == "logits" || w == "token" || w == "token+logits" ||
           w == "embedding";
}

bool is_drafter(std::string_view d) { return d.empty() || d == "ngram" || d == "mtp"; }

// Python's repr() of a str (valid UTF-8), as the messages of wire.py quote values: exact for
// code points below U+0100; above, the character is kept where Python would escape one it
// deems non-printable (\u / \U), a difference only a message about such a value shows.
std::string py_repr(std::string_view s) {
    static const char kHex[] = "0123456789abcdef";
    bool sq = s.find('\'') != std::string_view::npos;
    bool dq = s.find('"') != std::string_view::npos;
    char q = sq && !dq ? '"' : '\'';
    std::string out(1, q);
    for (size_t i = 0; i < s.size();) {
        uint8_t c = static_cast<uint8_t>(s[i]);
        if (c < 0x80) {
            ++i;
            if (c == static_cast<uint8_t>(q) || c == '\\') { out += '\\'; out += static_cast<char>(c); }
            else if (c == '\t') out += "\\t";
            else if (c == '\n') out += "\\n";
            else if (c == '\r') out += "\\r";
            else if (c < 0x20 || c == 0x7f) { out += "\\x"; out += kHex[c >> 4]; out += kHex[c & 15]; }
            else out += static_cast<char>(c);
            continue;
        }
        size_t k = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
        if (k == 2 && i + 1 < s.size()) {
            uint32_t cp = ((c & 0x1fu) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3fu);
            if (cp <= 0xa0 || cp == 0xad) {  // C1 controls, no-break space, soft hyphen
                out += "\\x"; out += kHex[cp >> 4]; out += kHex[cp & 15];
                i += 2;
                continue;
            }
        }
        k = std::min(k, s.size() - i);
        out.append(s.data() + i, k);
        i += k;
    }
    out += q;
    return out;
}

std::string num(int64_t v) { return std::to_string(v); }

// wire._check_forward, message for message; "" when the header is valid. `width` stands for
// h.width (the encoder checks the width it is about to write).
std::string check_forward(const Forward& h, int32_t width) {
    int64_t n = h.n_tokens;
    if (n < 1) return "Forward.n_tokens must be >= 1 (zero-token steps are rejected), got " + num(n);
    if (h.has_positions) {
        if (static_cast<int64_t>(h.positions.size()) != n)
            return "Forward.positions has " + num(static_cast<int64_t>(h.positions.size())) +
                   " entries but n_tokens is " + num(n);
        if (h.positions[0] != h.first_pos)
            return "Forward.positions[0] is " + num(h.positions[0]) + " but first_pos is " +
                   num(h.first_pos);
    } else if (static_cast<int64_t>(h.first_pos) + n - 1 > kI32Max) {
        return "Forward.first_pos " + num(h.first_pos) + " + n_tokens " + num(n) +
               " overflows int32 positions";
    }
    if (h.has_tokens && static_cast<int64_t>(h.tokens.size()) != n)
        return "Forward.tokens has " + num(static_cast<int64_t>(h.tokens.size())) +
               " ids but n_tokens is " + num(n);
    if (width == 0 && !h.has_tokens)
        return "Forward carries neither a boundary (width is 0) nor token ids";
    if (!is_want(h.want))
        return "unknown Forward.want " + py_repr(h.want) +
               " (known: boundary, logits, token, token+logits, embedding)";
    if (h.has_rows) {
        if (h.want == "embedding")
            return "Forward.want 'embedding' returns every row: rows must be None";
        if (h.rows.empty()) return "Forward.rows is empty (use None for the last row)";
        int32_t top = h.rows[0];
        for (int32_t row : h.rows) top = std::max(top, row);
        if (top >= n) return "Forward.rows names row " + num(top) + " but n_tokens is " + num(n);
    }
    if (h.has_relay && h.reply_to.empty())
        return "Forward.relay is set but reply_to is empty (where would the result go?)";
    bool token_want = h.want.substr(0, 5) == "token";
    if (h.steps > 1) {
        if (!h.has_loop || h.loop.empty() || h.reply_to.empty())
            return "Forward.steps is " + num(h.steps) + " but loop or reply_to is empty";
        if (!token_want)
            return "Forward.steps is " + num(h.steps) + " but want is " + py_repr(h.want) +
                   " (a loop feeds tokens)";
        if (h.has_rows) return "Forward.steps > 1 continues from the last row: rows must be None";
    }
    if (h.drafts) {
        if (h.drafts >= n)
            return "Forward.drafts is " + num(h.drafts) + " but n_tokens is " + num(n) +
                   " (a draft follows a token)";
        if (!token_want || h.has_rows)
            return "Forward.drafts asks the last stage to verify: want a token, rows None";
    }
    if (!is_drafter(h.speculate))
        return "unknown Forward.speculate " + py_repr(h.speculate) + " (known: ngram, mtp)";
    if (h.max_draft > kMaxDraft || h.drafts > kMaxDraft)
        return "Forward.max_draft / drafts may be at most " + num(kMaxDraft);
    if (!h.media.empty() && h.media != "image" && h.media != "audio")
        return "unknown Forward.media " + py_repr(h.media) + " (known: image, audio)";
    if (!h.media.empty()) {
        if (width == 0 || h.has_tokens) return "Forward.media carries rows (width > 0) and no token ids";
        if (h.steps > 1 || h.drafts) return "a Forward.media step is one step of prompt rows: no loop, no drafts";
    } else if (h.has_sections || !h.causal) {
        return "Forward.sections and causal=False are a media step's (Forward.media)";
    }
    if (h.has_sections) {
        if (static_cast<int64_t>(h.sections.size()) != kMropeSections * n)
            return "Forward.sections has " + num(static_cast<int64_t>(h.sections.size())) +
                   " entries but n_tokens is " + num(n) + " (" + num(kMropeSections) + " per row)";
        if (h.sections[0] != h.first_pos)
            return "Forward.sections[0] is " + num(h.sections[0]) + " but first_pos is " + num(h.first_pos);
        if (h.has_positions) return "Forward.sections replaces positions: one of them";
    }
    return std::string();
}

// wire._check_result, message for message; "" when valid.
std::string check_result(std::string_view kind, int64_t rows, int64_t cols) {
    if (kind != "none" && kind != "boundary" && kind != "logits" && kind != "embedding")
        return "unknown Result.kind " + py_repr(kind) +
               " (known: none, boundary, logits, embedding)";
    if (kind == "none") {
        if (rows || cols)
            return "Result.kind is 'none' but rows x cols is " + num(rows) + " x " + num(cols);
    } else if (!rows || !cols) {
        return "Result.kind is " + py_repr(kind) + " but rows x cols is " + num(rows) + " x " +
               num(cols);
    }
    return std::string();
}

uint32_t le32(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
           (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

Status fail(int code, std::string msg) { return Status(code, std::move(msg)); }

}  // namespace

void Forward::reset() {
    // The vectors keep their capacity; everything else takes its default.
    std::vector<int32_t> p = std::move(positions), t = std::move(tokens), r = std::move(rows),
                         s = std::move(stop_tokens), se = std::move(sections);
    std::vector<Hop> re = std::move(relay), lo = std::move(loop);
    *this = Forward{};
    p.clear(); t.clear(); r.clear(); s.clear(); se.clear(); re.clear(); lo.clear();
    positions = std::move(p); tokens = std::move(t); rows = std::move(r);
    stop_tokens = std::move(s); sections = std::move(se); relay = std::move(re); loop = std::move(lo);
}

void Result::reset() {
    std::vector<int32_t> t = std::move(tokens);
    *this = Result{};
    t.clear();
    tokens = std::move(t);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
uint64_t xxh3_avx2(const void* data, size_t size) noexcept;  // frame_xxh3_avx2.cpp
// cpu_init first: this initializer may run before libgcc's own constructor.
static const bool kHasAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
#endif

// XXH3-64, seed 0: AVX2 for long inputs when the CPU has it (inputs up to 240 bytes take no
// vector path in XXH3).
static inline uint64_t xxh3(const void* data, size_t size) noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (size > 240 && kHasAvx2) return xxh3_avx2(data, size);
#endif
    return XXH3_64bits(data, size);
}

uint64_t checksum(const void* data, size_t size) noexcept { return xxh3(data, size); }

Status decode_frame(const uint8_t* data, size_t size, const DecodeLimits& limits,
                    FrameView* out) noexcept {
    try {
        out->tag = kNoTag;
        out->array = nullptr;
        out->rows = out->cols = 0;
        out->payload_offset = 0;
        if (size < kPrefixSize)
            return fail(kFrameTruncated, "frame truncated: " + std::to_string(size) +
                                             " bytes, the prefix alone needs 16");
        if (std::memcmp(data, "DGRF", 4) != 0)
            return fail(kFrameError, "not a dgr frame: bad magic");
        uint8_t version = data[4], flags = data[5];
        uint16_t reserved = static_cast<uint16_t>(data[6] | (data[7] << 8));
        uint64_t hlen = le32(data + 8);
        uint32_t hsum = le32(data + 12);
        if (version != kFormatVersion) {
            if (version > kFormatVersion)
                return fail(kFrameVersion, "frame format version " + std::to_string(version) +
                                               " is newer than supported 1");
            return fail(kFrameError, "frame format version 0 is invalid (first is 1)");
        }
        if (flags) return fail(kFrameVersion, "frame sets unknown flag bits");
        if (reserved) return fail(kFrameError, "reserved prefix field is not 0");
        if (hlen > limits.max_header)
            return fail(kFrameTooLarge, "header length " + std::to_string(hlen) +
                                            " exceeds max_header " +
                                            std::to_string(limits.max_header));
        uint64_t poff = (kPrefixSize + hlen + kPayloadAlign - 1) & ~uint64_t{kPayloadAlign - 1};
        if (poff > size)
            return fail(kFrameTruncated, "frame truncated: header_len " + std::to_string(hlen) +
                                             " puts the payload at byte " + std::to_string(poff) +
                                             " but the frame has " + std::to_string(size) +
                                             " bytes");
        uint32_t got = static_cast<uint32_t>(xxh3(data + kPrefixSize, poff - kPrefixSize));
        if (got != hsum) return fail(kFrameChecksum, "header checksum mismatch");

        Reader r(data + kPrefixSize, data + kPrefixSize + hlen);
        uint64_t n;
        Int tag;
        bool ok = r.read_array(&n) && n >= 1 && r.read_int(&tag) && !tag.neg && tag.u >= 1 &&
                  tag.u <= 4;
        if (ok) {
            switch (tag.u) {
                case kForward: ok = read_forward(r, n - 1, &out->forward); break;
                case kResult: ok = read_result(r, n - 1, &out->result); break;
                case kErrorReply: ok = read_error(r, n - 1, &out->error); break;
                default: ok = read_hello(r, n - 1, &out->hello); break;
            }
        }
        if (!ok || !r.at_end())
            return fail(kFrameError, "invalid frame header (msgpack, or a field's type or range)");
        Tag t = static_cast<Tag>(tag.u);
        if (t == kErrorReply || t == kHello) {
            if (size != poff)
                return fail(kFrameError, std::string(t == kHello ? "Hello" : "ErrorReply") +
                                             " carries payload bytes, must carry none");
            out->tag = t;
            out->payload_offset = poff;
            return Status();
        }
        const Result& res = out->result;
        std::string err = t == kForward ? check_forward(out->forward, out->forward.width)
                                        : check_result(res.kind, res.rows, res.cols);
        if (!err.empty()) return fail(kFrameError, std::move(err));
        std::string_view dtype, codec, comp;
        uint64_t rows, cols, plen, sum;
        if (t == kForward) {
            const Forward& h = out->forward;
            dtype = h.dtype; codec = h.codec; comp = h.compression;
            rows = static_cast<uint64_t>(h.n_tokens); cols = static_cast<uint64_t>(h.width);
            plen = static_cast<uint64_t>(h.payload_len); sum = h.checksum;
        } else {
            const Result& h = out->result;
            dtype = h.dtype; codec = h.codec; comp = h.compression;
            rows = static_cast<uint64_t>(h.rows); cols = static_cast<uint64_t>(h.cols);
            plen = static_cast<uint64_t>(h.payload_len); sum = h.checksum;
        }
        if (dtype != "f32") return fail(kUnknownCodec, "unknown dtype (known: f32)");
        if (comp != "none" && comp != "zstd")
            return fail(kUnknownCodec, "unknown compression (known: none, zstd)");
        bool raw = codec == "raw";
        if (!raw && codec != "f16" && codec != "bf16" && codec != "q8")
            return fail(kUnknownCodec, "unknown codec (known: raw, f16, bf16, q8)");
        if (cols == 0 && (!raw || comp != "none" || plen))
            return fail(kFrameError, "a message without an array must have codec 'raw', "
                                     "compression 'none' and payload_len 0");
        // rows, cols < 2^31: 4 * rows * cols < 2^64 and rows * (4 + cols) < 2^63 cannot overflow.
        uint64_t f32_bytes = 4 * rows * cols;
        uint64_t expect = raw ? f32_bytes : codec == "q8" ? rows * (4 + cols) : 2 * rows * cols;
        if (expect > limits.max_payload || f32_bytes > limits.max_payload)
            return fail(kFrameTooLarge, std::to_string(rows) + " x " + std::to_string(cols) +
                                            " payload is above max_payload " +
                                            std::to_string(limits.max_payload));
        if (plen > limits.max_payload)
            return fail(kFrameTooLarge, "payload_len " + std::to_string(plen) +
                                            " exceeds max_payload " +
                                            std::to_string(limits.max_payload));
        bool zstd = comp == "zstd";
        if (!zstd) {
            if (plen != expect)
                return fail(kFrameError, "payload_len " + std::to_string(plen) +
                                             " disagrees with the payload size " +
                                             std::to_string(expect));
        } else if (plen == 0) {
            return fail(kFrameError, "zstd payload is empty");
        }
        uint64_t end = poff + plen;
        if (size != end) {
            if (size < end)
                return fail(kFrameTruncated, "frame truncated: the payload ends at byte " +
                                                 std::to_string(end) + " but the frame has " +
                                                 std::to_string(size) + " bytes");
            return fail(kFrameError,
                        std::to_string(size - end) + " trailing bytes after the payload");
        }
        if (xxh3(data + poff, plen) != sum)
            return fail(kFrameChecksum, "payload checksum mismatch");
        out->tag = t;
        out->payload_offset = poff;
        if (cols == 0) return Status();
        if (!raw || zstd)
            return fail(kFrameNotNative, "codec " + std::string(codec) + ", compression " +
                                             std::string(comp) + ": decode with dgr.protocol.wire");
        out->array = reinterpret_cast<const float*>(data + poff);
        out->rows = static_cast<int64_t>(rows);
        out->cols = static_cast<int64_t>(cols);
        return Status();
    } catch (const std::bad_alloc&) {
        return fail(kFrameError, "out of memory decoding a frame header");
    } catch (...) {
        return fail(kFrameError, "undecodable frame");
    }
}

// --- encode ------------------------------------------------------------------------

namespace {

// msgpack the way msgspec writes it: smallest int form, str8 for 32..255 bytes, float64.
class Writer {
public:
    explicit Writer(std::string* s) : s_(s) {}

    void u(uint64_t v) {
        if (v < 0x80) put(static_cast<uint8_t>(v));
        else if (v <= 0xff) { put(0xcc); be(v, 1); }
        else if (v <= 0xffff) { put(0xcd); be(v, 2); }
        else if (v <= 0xffffffffull) { put(0xce); be(v, 4); }
        else { put(0xcf); be(v, 8); }
    }
    void i(int64_t v) {
        if (v >= 0) return u(static_cast<uint64_t>(v));
        if (v >= -32) put(static_cast<uint8_t>(static_cast<int8_t>(v)));
        else if (v >= -128) { put(0xd0); be(static_cast<uint64_t>(v), 1); }
        else if (v >= -32768) { put(0xd1); be(static_cast<uint64_t>(v), 2); }
        else if (v >= -2147483648ll) { put(0xd2); be(static_cast<uint64_t>(v), 4); }
        else { put(0xd3); be(static_cast<uint64_t>(v), 8); }
    }
    void f(double v) {
        uint64_t bits;
        std::memcpy(&bits, &v, 8);
        put(0xcb);
        be(bits, 8);
    }
    void b(bool v) { put(v ? 0xc3 : 0xc2); }
    void nil() { put(0xc0); }
    void str(std::string_view v) {
        size_t n = v.size();
        if (n < 32) put(static_cast<uint8_t>(0xa0 | n));
        else if (n <= 0xff) { put(0xd9); be(n, 1); }
        else if (n <= 0xffff) { put(0xda); be(n, 2); }
        else { put(0xdb); be(n, 4); }
        s_->append(v.data(), n);
    }
    void array(size_t n) {
        if (n < 16) put(static_cast<uint8_t>(0x90 | n));
        else if (n <= 0xffff) { put(0xdc); be(n, 2); }
        else { put(0xdd); be(n, 4); }
    }
    void list(bool has, const std::vector<int32_t>& v) {
        if (!has) return nil();
        array(v.size());
        for (int32_t x : v) i(x);
    }
    void hops(bool has, const std::vector<Hop>& v) {
        if (!has) return nil();
        array(v.size());
        for (const Hop& h : v) {
            array(2);
            str(h.endpoint);
            b(h.tokens);
        }
    }

private:
    void put(uint8_t c) { s_->push_back(static_cast<char>(c)); }
    void be(uint64_t v, int n) {
        for (int k = n - 1; k >= 0; --k) put(static_cast<uint8_t>(v >> (8 * k)));
    }
    std::string* s_;
};

const uint64_t kEmptySum = XXH3_64bits(nullptr, 0);

// Prefix + header + padding into out->head, once the msgpack header is in out->head[16:].
void finish_head(EncodedFrame* out) {
    std::string& s = out->head;
    size_t hlen = s.size() - kPrefixSize;
    size_t pad = (kPayloadAlign - (s.size() % kPayloadAlign)) % kPayloadAlign;
    s.append(pad, '\0');
    uint32_t hsum = static_cast<uint32_t>(xxh3(s.data() + kPrefixSize, s.size() - kPrefixSize));
    uint8_t* p = reinterpret_cast<uint8_t*>(&s[0]);
    std::memcpy(p, "DGRF", 4);
    p[4] = kFormatVersion;
    p[5] = 0;
    p[6] = p[7] = 0;
    for (int k = 0; k < 4; ++k) p[8 + k] = static_cast<uint8_t>(hlen >> (8 * k));
    for (int k = 0; k < 4; ++k) p[12 + k] = static_cast<uint8_t>(hsum >> (8 * k));
}

void start(EncodedFrame* out) {
    out->head.clear();
    out->head.append(kPrefixSize, '\0');
    out->payload = nullptr;
    out->payload_len = 0;
}

}  // namespace

void EncodedFrame::copy_to(uint8_t* dst) const {
    std::memcpy(dst, head.data(), head.size());
    if (payload_len) std::memcpy(dst + head.size(), payload, payload_len);
}

// encode_forward and encode_result are deliberate parallels, each the C++ twin of wire.encode
// for its message: the array's checks, then the header's fields in the order of the Python
// tables (tests/unit/test_frame_native.py checks both against wire, field by field).
Status encode_forward(const Forward& h, const float* array, int64_t rows, int64_t cols,
                      EncodedFrame* out) {
    int32_t width = h.width;
    uint64_t plen = 0, sum = kEmptySum;
    if (!array) {
        if (h.width)
            return fail(kInvalidBoundary, "Forward.width is " + std::to_string(h.width) +
                                              " but no array was given");
        if (std::string err = check_forward(h, 0); !err.empty())
            return fail(kInvalidArgument, std::move(err));
    } else {
        if (rows != h.n_tokens)
            return fail(kInvalidBoundary, "array has " + std::to_string(rows) +
                                              " rows but Forward.n_tokens is " +
                                              std::to_string(h.n_tokens));
        if (h.width && h.width != cols)
            return fail(kInvalidBoundary, "array has width " + std::to_string(cols) +
                                              " but Forward.width is " + std::to_string(h.width));
        if (cols == 0) return fail(kInvalidBoundary, "array has width 0");
        if (cols > kI32Max) return fail(kInvalidBoundary, "array width does not fit int32");
        width = static_cast<int32_t>(cols);
        plen = 4 * static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
        sum = xxh3(array, plen);
        if (std::string err = check_forward(h, width); !err.empty())
            return fail(kInvalidArgument, std::move(err));
    }
    start(out);
    Writer w(&out->head);
    w.array(33);  // the tag and Forward's 32 fields
    w.u(kForward);
    w.u(h.schema);
    w.str(h.model);
    w.str(h.session);
    w.i(h.epoch);
    w.i(h.first_pos);
    w.i(h.n_tokens);
    w.i(h.layer);
    w.i(width);
    w.i(h.reserved);
    w.str("f32");
    w.str("raw");
    w.str("none");
    w.u(plen);
    w.u(sum);
    w.list(h.has_positions, h.positions);
    w.list(h.has_tokens, h.tokens);
    w.str(h.want);
    w.list(h.has_rows, h.rows);
    if (h.has_sampling) {
        const Sampling& s = h.sampling;
        w.array(15);
        w.f(s.temperature);
        w.i(s.top_k);
        w.f(s.top_p);
        w.u(s.seed);
        w.b(s.greedy);
        w.f(s.min_p);
        w.list(true, s.bias_ids);
        w.array(s.bias.size());
        for (double x : s.bias) w.f(x);
        w.i(s.penalty_last_n);
        w.f(s.repeat_penalty);
        w.f(s.frequency_penalty);
        w.f(s.presence_penalty);
        w.str(s.grammar);
        w.u(s.grammar_id);
        w.i(s.grammar_from);
    } else {
        w.nil();
    }
    w.hops(h.has_relay, h.relay);
    w.str(h.reply_to);
    w.hops(h.has_loop, h.loop);
    w.i(h.steps);
    w.list(h.has_stop_tokens, h.stop_tokens);
    w.b(h.solo);
    w.i(h.rollback);
    w.i(h.drafts);
    w.str(h.speculate);
    w.i(h.max_draft);
    w.str(h.media);
    w.list(h.has_sections, h.sections);
    w.b(h.causal);
    finish_head(out);
    out->payload = reinterpret_cast<const uint8_t*>(array);
    out->payload_len = static_cast<size_t>(plen);
    return Status();
}

Status encode_result(const Result& h, const float* array, int64_t rows, int64_t cols,
                     EncodedFrame* out) {
    int64_t r = h.rows, c = h.cols;
    uint64_t plen = 0, sum = kEmptySum;
    if (!array) {
        if (h.rows || h.cols)
            return fail(kInvalidBoundary, "Result.rows x cols is " + std::to_string(h.rows) +
                                              " x " + std::to_string(h.cols) +
                                              " but no array was given");
        if (std::string err = check_result(h.kind, 0, 0); !err.empty())
            return fail(kInvalidArgument, std::move(err));
    } else {
        if (h.kind == "none")
            return fail(kInvalidArgument,
                        "Result.kind must be 'boundary', 'logits' or 'embedding' when an array is sent");
        if (rows == 0 || cols == 0) return fail(kInvalidBoundary, "array shape is empty");
        if (rows > kI32Max || cols > kI32Max)
            return fail(kInvalidBoundary, "array shape does not fit int32");
        r = rows;
        c = cols;
        plen = 4 * static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
        sum = xxh3(array, plen);
        if (std::string err = check_result(h.kind, r, c); !err.empty())
            return fail(kInvalidArgument, std::move(err));
    }
    start(out);
    Writer w(&out->head);
    w.array(18);  // the tag and Result's 17 fields
    w.u(kResult);
    w.u(h.schema);
    w.str(h.session);
    w.i(h.epoch);
    w.i(h.first_pos);
    w.i(h.n_tokens);
    w.str(h.kind);
    w.i(h.layer);
    w.i(r);
    w.i(c);
    w.i(h.reserved);
    w.str("f32");
    w.str("raw");
    w.str("none");
    w.u(plen);
    w.u(sum);
    w.list(h.has_tokens, h.tokens);
    w.i(h.drafted);
    finish_head(out);
    out->payload = reinterpret_cast<const uint8_t*>(array);
    out->payload_len = static_cast<size_t>(plen);
    return Status();
}

}  // namespace wire
}  // namespace dgr
