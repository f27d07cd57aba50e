"""What the server and the client of the shard service share: names, limits, options."""

from __future__ import annotations

from typing import Any

from dgr.protocol import wire

__all__ = ["SERVICE", "STEP_METHOD", "HEALTH_SERVICE", "MAX_MESSAGE", "MAX_PIECES",
           "server_options", "channel_options"]

SERVICE = "dgr.v1.Shard"
#: The data-plane method: a bidirectional stream of raw dgr.protocol.wire frames
#: (see proto/dgr.proto).
STEP_METHOD = f"/{SERVICE}/Step"
#: Service name under which the worker reports health (besides the overall "").
HEALTH_SERVICE = SERVICE

#: Largest gRPC message either side accepts: the wire's own payload and header limits plus
#: the prefix and padding, so gRPC never refuses a frame the wire format would accept.
MAX_MESSAGE = wire.MAX_PAYLOAD + wire.MAX_HEADER + 4096
#: the most token ids one TokenPieces call renders (a page of the vocabulary)
MAX_PIECES = 65536

# Keepalive: the client pings an idle connection every 20 s and gives up after 10 s without
# an answer (a dead worker is noticed without a step deadline); the server accepts pings that
# often, even without calls in flight, and pings its clients every 60 s.
_CLIENT_KEEPALIVE_MS = 20_000


def server_options(max_message: int = MAX_MESSAGE) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _CLIENT_KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # a second worker on the same port must fail, not share it
    ]


def channel_options(max_message: int = MAX_MESSAGE) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.keepalive_time_ms", _CLIENT_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # reconnect quickly to a worker restarted under the same address
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # gRPC reads its minimum connect timeout (the time a TCP + HTTP/2 handshake may take)
        # from this argument: at 100 ms, no link with a round trip above ~100 ms (a WAN) and
        # no loaded worker (30 processes starting on 2 cores) could connect at all. 20 s is
        # gRPC's own default; the calls' deadlines still bound every wait.
        ("grpc.min_reconnect_backoff_ms", 20_000),
        ("grpc.enable_retries", 0),  # the route driver decides what to retry
    ]
