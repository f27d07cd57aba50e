"""A stage's describe record (``StageInfo``), and the compute figures read from two of them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from dgr.protocol.settings import CPU, NUMERIC_SETTINGS, compute_kind, stage_identity

__all__ = ["StageInfo", "COUNTERS", "DEVICE_FIELDS", "PREFIX_STORE_FIELDS", "compute_between",
           "measured_compute"]


#: DescribeReply's compute totals (proto3 ``optional``: unset on a worker older than them)
COUNTERS = ("decode_steps_total", "decode_compute_s_total", "tokens_computed_total",
             "compute_s_total")


@dataclass(frozen=True)
class StageInfo:
    """A worker's describe record, as plain Python (``ShardClient.describe`` returns it).

    A deliberate parallel of the proto's ``DescribeReply`` (and of its generated stub): the
    client's typed view. ``tests/unit/test_describe_schema.py`` fails when a field is in one
    and not the other, or not filled by ``Worker.describe``."""

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
    #: the drafters the worker runs as a route's last stage (docs/speculative.md)
    drafters: tuple = ()
    #: the compute device (``ComputeDevice`` fields: backend, name, type, description,
    #: driver, software, memory and bytes held); empty from a worker older than it (the CPU)
    device: dict = field(default_factory=dict)
    #: whether the stage computes a partial prefill chunk's rows as any partial chunk does
    #: (measured when it started; False from a worker older than the field)
    prefix_rows_exact: bool = False
    #: whether the stage computes rows one per step (decode steps) as a partial chunk does
    #: (measured when it started; False from a worker older than the field)
    prefix_single_rows_exact: bool = False
    #: whether the stage computes a whole chunk's rows as partial chunks do (measured when it
    #: started where partial chunks' rows are alike; False from a worker older than the field)
    prefix_chunk_rows_exact: bool = False
    #: the prefix store's figures (``PREFIX_STORE_FIELDS``: size, entries, positions, bytes,
    #: hits, misses, evictions); empty from a worker older than the store (none)
    prefix_store: dict = field(default_factory=dict)
    #: the most positions the stage's caches drop from a slot's tail: 0 none (a recurrent or
    #: hybrid model's state), -1 no limit (so too from a worker older than the field)
    rollback_window: int = -1
    #: a recurrent or hybrid model's stage: its state bytes per session (counted in
    #: ``kv_bytes`` too), and the state snapshots it keeps per session at the ends of whole
    #: chunks prefilled from position 0 (0: none, so too from an older worker)
    state_bytes: int = 0
    state_snapshots: int = 0
    #: context tokens per session the stage holds: ``settings["n_ctx"]`` as set, or the one it
    #: chose for ``n_ctx`` 0 (its trained context ``n_ctx_train``, capped by its KV budget;
    #: ``n_ctx_source`` says how). 0 where not given (an older worker): ``settings["n_ctx"]``
    n_ctx: int = 0
    n_ctx_train: int = 0
    n_ctx_source: str = ""
    #: the projector beside this stage (the first, ``--mmproj``): its prompt marker ("": none)
    #: and whether it takes images and audio (``AsyncRoute.encode_media``)
    media_marker: str = ""
    media_vision: bool = False
    media_audio: bool = False
    #: the llama.cpp pin of the stage's compiled core: its commit and dgr's patch-stack hash
    #: ("": an older worker, which did not say); ``check_route`` refuses a route that mixes
    #: pins
    llama_cpp_commit: str = ""
    patch_stack_hash: str = ""
    #: the CPU code of that core (``native``, ``x86-64-v3``; "": an older worker): a route
    #: refuses stages of different variants unless ``mixed_devices`` asks
    cpu_variant: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.n_ctx:
            object.__setattr__(self, "n_ctx", int(self.settings.get("n_ctx", 0)))

    @functools.cached_property
    def compute(self) -> str:
        """The kind of the stage's device (``compute_kind``): ``"cpu"`` or, e.g.,
        ``"vulkan:llvmpipe (LLVM 15.0.6, 256 bits)"``."""
        if not self.device:
            return CPU
        return compute_kind(self.device.get("backend", CPU), self.device.get("description", ""))

    @functools.cached_property
    def identity(self) -> str:
        """The stage identity frames must carry (model, numeric settings, device kind)."""
        return stage_identity(self.model_identity, self.settings, self.compute)

    @property
    def data_endpoint(self) -> str | None:
        """``host:port`` of the fast data plane (the gRPC endpoint's host), None without one."""
        if not self.data_port:
            return None
        return f"{self.endpoint.rsplit(':', 1)[0]}:{self.data_port}"

    @classmethod
    def from_proto(cls, endpoint: str, r) -> StageInfo:
        s = r.settings
        settings = {k: getattr(s, k) for k in NUMERIC_SETTINGS}
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
            uptime_s=r.uptime_s, data_port=r.data_port, drafters=tuple(r.drafters),
            device=_device_dict(r.device) if r.HasField("device") else {},
            prefix_rows_exact=r.HasField("prefix_rows_exact") and r.prefix_rows_exact,
            prefix_single_rows_exact=(r.HasField("prefix_single_rows_exact")
                                      and r.prefix_single_rows_exact),
            prefix_chunk_rows_exact=(r.HasField("prefix_chunk_rows_exact")
                                     and r.prefix_chunk_rows_exact),
            prefix_store=({k: int(getattr(r.prefix_store, k)) for k in PREFIX_STORE_FIELDS}
                          if r.HasField("prefix_store") else {}),
            rollback_window=r.rollback_window if r.HasField("rollback_window") else -1,
            state_bytes=r.state_bytes, state_snapshots=r.state_snapshots,
            n_ctx=r.n_ctx, n_ctx_train=r.n_ctx_train, n_ctx_source=r.n_ctx_source,
            media_marker=r.media_marker, media_vision=r.media_vision,
            media_audio=r.media_audio, llama_cpp_commit=r.llama_cpp_commit,
            patch_stack_hash=r.patch_stack_hash, cpu_variant=r.cpu_variant,
            **{k: getattr(r, k) if r.HasField(k) else None for k in COUNTERS})

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "extra"}
        d["layers"] = list(self.layers)
        d["eog_tokens"] = sorted(self.eog_tokens)
        d["drafters"] = list(self.drafters)
        d["identity"] = self.identity
        d["compute"] = self.compute
        return d


#: ``PrefixStore``'s fields, as ``StageInfo.prefix_store`` keys them
PREFIX_STORE_FIELDS = ("size", "entries", "positions", "bytes", "hits", "misses", "evictions")

#: ``ComputeDevice``'s fields, as ``StageInfo.device`` keys them
DEVICE_FIELDS = ("backend", "name", "type", "description", "driver", "software", "memory_free",
                 "memory_total", "weight_bytes", "kv_bytes", "compute_bytes")


def _device_dict(m) -> dict:
    return {k: getattr(m, k) for k in DEVICE_FIELDS}


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
