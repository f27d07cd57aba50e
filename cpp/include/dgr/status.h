// dgr::Status: errors cross the C++/Python boundary as values, never as aborts.
// The numeric codes are shared with dgr/errors.py (class attribute `code`).
#pragma once

#include <string>
#include <utility>

namespace dgr {

enum StatusCode : int {
    kOk                 = 0,
    kModelNotFound      = 1,
    kInvalidModel       = 2,
    kUnsupportedArch    = 3,
    kInvalidLayerRange  = 4,
    kInvalidToken       = 5,
    kInvalidPosition    = 6,
    kContextFull        = 7,
    kUnknownSlot        = 8,
    kInvalidBoundary    = 9,
    kMissingTokenIds    = 10,
    kMtpNotSupported    = 11,
    kInvalidArgument    = 12,
    kEngineError        = 13,
    kRollbackUnsupported = 15, // a partial tail removal this cache cannot do: re-prefill
    kDeviceNotFound     = 16, // no such compute device, or its backend is not in this build
    kDeviceOutOfMemory  = 17, // the range does not fit the device's free memory (or its cap)
    kDeviceLost         = 18, // the device failed mid-run: the engine refuses further work
    // wire frames (cpp/include/dgr/frame.h, dgr/protocol/wire.py)
    kFrameError         = 20,
    kFrameTruncated     = 21,
    kFrameTooLarge      = 22,
    kFrameChecksum      = 23,
    kFrameVersion       = 24,
    kUnknownCodec       = 25,
    kFrameNotNative     = 26,
};

struct Status {
    int code = kOk;
    std::string message;

    Status() = default;
    Status(int c, std::string m) : code(c), message(std::move(m)) {}
    bool ok() const { return code == kOk; }
};

}  // namespace dgr
