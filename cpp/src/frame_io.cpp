// dgr data-plane frame I/O (cpp/include/dgr/frame_io.h).
#include "dgr/frame_io.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

namespace dgr {
namespace wire {

namespace {

// A non-blocking socket (a Python socket with a timeout is one) would answer EAGAIN: wait
// until it is ready instead. Returns 0 or an errno.
int wait_ready(int fd, short events) noexcept {
    struct pollfd p = {fd, events, 0};
    while (::poll(&p, 1, -1) < 0) {
        if (errno != EINTR) return errno;
    }
    return 0;
}

inline bool again(int e) noexcept { return e == EAGAIN || e == EWOULDBLOCK; }

constexpr int kMaxIov = 1024;  // IOV_MAX on Linux: sendmsg refuses more pieces

// Read n bytes; *got says how many arrived before an end of stream or error. With
// deadline_ms >= 0, once a byte has arrived (counting *got on entry) each wait for more is
// bounded by what is left until `deadline` (a steady_clock time point): kIoTimeout then.
int read_all(int fd, uint8_t* buf, size_t n, size_t* got, bool bounded,
             std::chrono::steady_clock::time_point deadline) noexcept {
    *got = 0;
    while (*got < n) {
        ssize_t k = ::recv(fd, buf + *got, n - *got, bounded ? MSG_DONTWAIT : 0);
        if (k > 0) {
            *got += static_cast<size_t>(k);
        } else if (k == 0) {
            return kIoTruncated;
        } else if (again(errno)) {
            if (!bounded) {
                if (int rc = wait_ready(fd, POLLIN)) return rc;
                continue;
            }
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now()).count();
            if (left <= 0) return kIoTimeout;
            struct pollfd p = {fd, POLLIN, 0};
            int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
            if (rc == 0) return kIoTimeout;
            if (rc < 0 && errno != EINTR) return errno;
        } else if (errno != EINTR) {
            return errno;
        }
    }
    return 0;
}

std::chrono::steady_clock::time_point after_ms(int64_t ms) noexcept {
    return std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
}

}  // namespace

int recv_exact(int fd, uint8_t* buf, size_t n, int64_t timeout_ms) noexcept {
    size_t got;
    return read_all(fd, buf, n, &got, timeout_ms >= 0, after_ms(timeout_ms < 0 ? 0 : timeout_ms));
}

int recv_frame(int fd, uint8_t* buf, size_t cap, size_t max_frame, int64_t timeout_ms,
               size_t* size, int64_t spin_us) noexcept {
    uint8_t len[kLengthPrefix];
    size_t got = 0;
    int rc;
    // busy-poll first: read without blocking until a byte comes or spin_us passes
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    bool spinning = spin_us > 0;
    // the first byte may take as long as it takes (a connection idles between frames);
    // from there the frame is under way and, with a timeout, must be whole in time
    for (;;) {
        ssize_t k = ::recv(fd, len, kLengthPrefix, spinning ? MSG_DONTWAIT : 0);
        if (k < 0 && spinning && again(errno)) {
            spinning = std::chrono::steady_clock::now() < spin_end;
            continue;
        }
        if (k > 0) { got = static_cast<size_t>(k); break; }
        if (k == 0) return kIoEof;
        if (again(errno)) {
            if ((rc = wait_ready(fd, POLLIN))) return rc;
        } else if (errno != EINTR) {
            return errno;
        }
    }
    const bool bounded = timeout_ms >= 0;
    const auto deadline = after_ms(bounded ? timeout_ms : 0);
    if (got < kLengthPrefix) {
        size_t more;
        rc = read_all(fd, len + got, kLengthPrefix - got, &more, bounded, deadline);
        if (rc) return rc;
    }
    const uint32_t n = static_cast<uint32_t>(len[0]) | static_cast<uint32_t>(len[1]) << 8 |
                       static_cast<uint32_t>(len[2]) << 16 | static_cast<uint32_t>(len[3]) << 24;
    *size = n;
    if (n > max_frame) return kIoTooLarge;
    if (n > cap) return kIoNeedBuffer;
    return read_all(fd, buf, n, &got, bounded, deadline);
}

int send_iov(int fd, struct iovec* iov, int count, size_t* sent) noexcept {
    *sent = 0;
    int first = 0;
    while (first < count) {
        struct msghdr msg;
        std::memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov + first;
        msg.msg_iovlen = static_cast<size_t>(std::min(count - first, kMaxIov));
        ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (again(errno)) {
                if (int rc = wait_ready(fd, POLLOUT)) return rc;
                continue;
            }
            return errno;
        }
        *sent += static_cast<size_t>(k);
        size_t left = static_cast<size_t>(k);  // skip what was sent, resume mid-piece
        while (first < count && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            ++first;
        }
        if (first < count) {
            iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
            iov[first].iov_len -= left;
        }
    }
    return 0;
}

void length_prefix(size_t n, uint8_t out[kLengthPrefix]) noexcept {
    out[0] = static_cast<uint8_t>(n);
    out[1] = static_cast<uint8_t>(n >> 8);
    out[2] = static_cast<uint8_t>(n >> 16);
    out[3] = static_cast<uint8_t>(n >> 24);
}

int send_frame(int fd, const uint8_t* head, size_t head_len, const uint8_t* payload,
               size_t payload_len) noexcept {
    uint8_t len[kLengthPrefix];
    length_prefix(head_len + payload_len, len);
    struct iovec iov[3] = {{len, kLengthPrefix},
                           {const_cast<uint8_t*>(head), head_len},
                           {const_cast<uint8_t*>(payload), payload_len}};
    size_t sent;
    return send_iov(fd, iov, payload_len ? 3 : 2, &sent);
}

bool readable(int fd) noexcept {
    struct pollfd p = {fd, POLLIN, 0};
    int rc;
    do {
        rc = ::poll(&p, 1, 0);
    } while (rc < 0 && errno == EINTR);
    return rc > 0 && (p.revents & POLLIN);
}

}  // namespace wire
}  // namespace dgr
