// dgr data-plane frame I/O on a connected stream socket (docs/dataplane.md): every frame is
// preceded by its length (u32, little endian). Blocking calls, meant to run without the GIL.
//
// Errors come back as an errno value (> 0; EPIPE/ECONNRESET/... as the kernel says) or as
// one of the codes below (< 0), never as an exception; EINTR is retried.
#pragma once

#include <cstddef>
#include <cstdint>

#include <sys/uio.h>

namespace dgr {
namespace wire {

constexpr size_t kLengthPrefix = 4;

// recv_frame's outcomes besides 0 (a frame read) and an errno.
constexpr int kIoEof = -1;         // clean end of stream before the length prefix
constexpr int kIoTruncated = -2;   // the peer closed inside a prefix or a frame
constexpr int kIoTooLarge = -3;    // the prefix claims more than max_frame bytes
constexpr int kIoNeedBuffer = -4;  // the frame is larger than cap: *size says how large;
                                   // nothing of it is read yet (call recv_exact with a
                                   // buffer of *size bytes)
constexpr int kIoTimeout = -5;     // the frame was not whole within timeout_ms of its
                                   // first byte (a stalled or slow-dripping peer)

// Read one length prefix and, when it fits in cap bytes, the frame into buf. The wait for
// the first byte is unbounded (a connection idles between frames); with timeout_ms >= 0 the
// rest of the prefix and the frame must arrive within timeout_ms of it (kIoTimeout).
// On 0 and on kIoNeedBuffer/kIoTooLarge, *size is the frame's length. With spin_us > 0 the
// wait for the first byte polls the socket without sleeping for up to spin_us microseconds
// before it blocks (busy-polling: the thread, and its core, stay awake for a frame that
// comes soon).
int recv_frame(int fd, uint8_t* buf, size_t cap, size_t max_frame, int64_t timeout_ms,
               size_t* size, int64_t spin_us = 0) noexcept;

// Read exactly n bytes into buf within timeout_ms (< 0: unbounded): 0, kIoTruncated,
// kIoTimeout or an errno.
int recv_exact(int fd, uint8_t* buf, size_t n, int64_t timeout_ms) noexcept;

// Write the length prefix of (head_len + payload_len), head and payload as one gather write,
// finishing partial writes (MSG_NOSIGNAL: a broken pipe is EPIPE, not a signal).
// Returns 0 or an errno.
int send_frame(int fd, const uint8_t* head, size_t head_len, const uint8_t* payload,
               size_t payload_len) noexcept;

// Write the pieces iov[0, count) in order as one stream (gather writes of at most IOV_MAX
// pieces each), finishing partial writes; iov is consumed (its entries are advanced).
// *sent: the bytes written before a failure (0: nothing of it went out). 0 or an errno.
int send_iov(int fd, struct iovec* iov, int count, size_t* sent) noexcept;

// The 4-byte little-endian length prefix of an n-byte frame.
void length_prefix(size_t n, uint8_t out[kLengthPrefix]) noexcept;

// Whether bytes wait to be read on fd (a poll without waiting; false on an error).
bool readable(int fd) noexcept;

}  // namespace wire
}  // namespace dgr
