"""What the server and the client of the shard service share: names, limits, options, records."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from .. import wire

__all__ = [
    "SERVICE", "STEP_METHOD", "HEALTH_SERVICE", "MAX_MESSAGE", "server_options",
    "channel_options", "settings_tag", "stage_identity", "StageInfo",
]

SERVICE = "dgr.v1.Shard"
#: The data-plane method: a bidirectional stream of raw dgr.wire frames (see proto/dgr.proto).
STEP_METHOD = f"/{SERVICE}/Step"
#: Service name under which the worker reports health (besides the overall "").
HEALTH_SERVICE = SERVICE

#: Largest gRPC message either side accepts: the wire's own payload and header limits plus
#: the prefix and padding, so gRPC never refuses a frame the wire format would accept.
MAX_MESSAGE = wire.MAX_PAYLOAD + wire.MAX_HEADER + 4096

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
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.enable_retries", 0),  # the route driver decides what to retry
    ]


_TAGS = (("n_ctx", "ctx"), ("n_slots", "slots"), ("n_threads", "t"), ("n_ubatch", "ub"),
         ("flash_attn", "fa"), ("type_k", "k"), ("type_v", "v"))


def settings_tag(settings: dict) -> str:
    """A short, stable spelling of the numeric engine settings, e.g. ``ctx1024.slots4.t1...``."""
    parts = []
    for key, short in _TAGS:
        v = settings[key]
        parts.append(f"{short}{int(v) if isinstance(v, bool) else v}")
    return ".".join(parts)


def stage_identity(model_identity: str, settings: dict) -> str:
    """What a Forward frame's ``model`` field names: the model file and the numeric settings.

    Two stages compute compatible numbers only when both agree, so a frame built for another
    model *or* other settings is refused with ``ModelMismatch``.
    """
    return f"{model_identity}+{settings_tag(settings)}"


#: DescribeReply's compute totals (proto3 ``optional``: unset on a worker older than them)
_COUNTERS = ("decode_steps_total", "decode_compute_s_total", "tokens_computed_total",
             "compute_s_total")


@dataclass(frozen=True)
class StageInfo:
    """A worker's describe record, as plain Python (``ShardClient.describe`` returns it)."""

    endpoint: str
    model_identity: str
    model_name: str
    arch: str
    n_layer: int
    layers: tuple[int, int]
    is_first: bool
    is_last: bool
    needs_token_ids: bool
    boundary_width: int
    boundary_dtype: str
    n_vocab: int
    settings: dict
    eog_tokens: frozenset
    add_bos: bool
    free_slots: int
    sessions: int
    free_context: int
    queue_depth: int
    recent_tokens_per_s: float
    recent_step_ms: float
    draining: bool
    dgr_version: str
    wire_format_version: int
    wire_schema_version: int
    weight_bytes: int
    kv_bytes: int
    steps_total: int
    errors_total: int
    uptime_s: float
    #: TCP port of the worker's fast data plane on the endpoint's host (0: none)
    data_port: int = 0
    #: compute totals since the worker started (monotonic, exact; take deltas between two
    #: describes of the same worker): single-token steps and their compute seconds, tokens
    #: and compute seconds of every step. None: a worker older than these counters.
    decode_steps_total: int | None = None
    decode_compute_s_total: float | None = None
    tokens_computed_total: int | None = None
    compute_s_total: float | None = None
    extra: dict = field(default_factory=dict)

    @functools.cached_property
    def identity(self) -> str:
        """The stage identity frames must carry (model and numeric settings)."""
        return stage_identity(self.model_identity, self.settings)

    @property
    def data_endpoint(self) -> str | None:
        """``host:port`` of the fast data plane (the gRPC endpoint's host), None without one."""
        if not self.data_port:
            return None
        return f"{self.endpoint.rsplit(':', 1)[0]}:{self.data_port}"

    @classmethod
    def from_proto(cls, endpoint: str, r) -> StageInfo:
        s = r.settings
        settings = {"n_ctx": s.n_ctx, "n_slots": s.n_slots, "n_threads": s.n_threads,
                    "n_ubatch": s.n_ubatch, "flash_attn": s.flash_attn, "type_k": s.type_k,
                    "type_v": s.type_v}
        return cls(
            endpoint=endpoint, model_identity=r.model_identity, model_name=r.model_name,
            arch=r.arch, n_layer=r.n_layer, layers=(r.layer_start, r.layer_end),
            is_first=r.is_first, is_last=r.is_last, needs_token_ids=r.needs_token_ids,
            boundary_width=r.boundary_width, boundary_dtype=r.boundary_dtype,
            n_vocab=r.n_vocab, settings=settings, eog_tokens=frozenset(r.eog_tokens),
            add_bos=r.add_bos, free_slots=r.free_slots, sessions=r.sessions,
            free_context=r.free_context, queue_depth=r.queue_depth,
            recent_tokens_per_s=r.recent_tokens_per_s, recent_step_ms=r.recent_step_ms,
            draining=r.draining, dgr_version=r.dgr_version,
            wire_format_version=r.wire_format_version,
            wire_schema_version=r.wire_schema_version, weight_bytes=r.weight_bytes,
            kv_bytes=r.kv_bytes, steps_total=r.steps_total, errors_total=r.errors_total,
            uptime_s=r.uptime_s, data_port=r.data_port,
            **{k: getattr(r, k) if r.HasField(k) else None for k in _COUNTERS})

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        d["layers"] = list(self.layers)
        d["eog_tokens"] = sorted(self.eog_tokens)
        d["identity"] = self.identity
        return d


def compute_between(before, after) -> list[tuple[int, float] | str]:
    """What each stage's worker computed between two describes of a route (``before`` a
    timed run, ``after`` it; lists of ``StageInfo``): (single-token steps, their compute
    seconds), from the workers' exact totals (``decode_steps_total``,
    ``decode_compute_s_total``), or why there is no figure (a str)."""
    if len(before) != len(after):
        return [f"the route had {len(before)} stage(s) before the generation, "
                f"{len(after)} after"] * len(after)
    out: list[tuple[int, float] | str] = []
    for b, a in zip(before, after):
        if a.decode_steps_total is None or b.decode_steps_total is None:
            out.append(f"{a.endpoint} reports no compute totals (a worker older than "
                       "Describe fields 33-36, dgr_version "
                       f"{a.dgr_version or '?'}): no compute figure")
        elif a.endpoint != b.endpoint:
            out.append(f"the stage moved from {b.endpoint} to {a.endpoint} during the "
                       "generation: no compute figure")
        elif a.decode_steps_total < b.decode_steps_total or a.uptime_s < b.uptime_s:
            out.append(f"{a.endpoint} restarted during the generation: no compute figure")
        elif a.decode_steps_total == b.decode_steps_total:
            out.append(f"{a.endpoint} computed no single-token step: no compute figure")
        else:
            out.append((a.decode_steps_total - b.decode_steps_total,
                        a.decode_compute_s_total - b.decode_compute_s_total))
    return out


def measured_compute(before, after) -> list[tuple[int, float]]:
    """``compute_between`` for a benchmark, which needs a figure for every stage: raises
    RuntimeError with the reasons when a stage has none (an older worker, one replaced or
    restarted during the run, no single-token step)."""
    out = compute_between(before, after)
    why = [x for x in out if isinstance(x, str)]
    if why:
        raise RuntimeError("; ".join(why))
    return out
