"""The capability record's schema: what a worker tells an external tracker (docs/capability.md).

A worker serves it as JSON in ``DescribeReply.capability_json``; ``ShardClient.capability()``
decodes it with :func:`decode`; ``dgr.control.capability.record_for`` builds it. The record is
*inputs*, not a routing decision: exact compatibility, range and capacity, queue and load, seam
cost, health, and the certified lanes whose records match this worker exactly.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

__all__ = ["SCHEMA", "Compatibility", "Capacity", "Load", "Seam", "Health", "PrefixStore",
           "LaneRef", "Uncertified", "LayerTimes", "Capability", "encode", "decode"]


#: Version of this record's JSON form (bumped when a field changes meaning or goes away).
#: 2: ``health.engine_restarts`` is gone (it was always 0: a worker never reloads its engine).
#: 3: ``compatibility.arch_splittable``; a multi-stage lane needs it true.
#: 4: the compute device: ``compatibility.backend`` is the engine's (``cpu``, ``vulkan``,
#:    ``cuda``, ...), with ``device``, ``device_type``, ``device_driver``, ``software_device``
#:    and ``compute``; ``capacity.device_*`` bytes; lanes say their device.
SCHEMA = 4


class Compatibility(msgspec.Struct, kw_only=True):
    model_identity: str            # "sha256:<hex>" (dgr.artifacts.identity)
    model_name: str
    arch: str
    # whether this build splits ``arch`` bit-exact (its graph honours a layer range: the
    # patched llama.cpp's list, each entry proven by the support table, docs/architectures.md);
    # false: only a whole-model (one-stage) lane can hold
    arch_splittable: bool = False
    quantisation: str              # GGUF general.file_type name, e.g. "Q4_1"
    backend: str                   # the engine's device's backend: "cpu", "vulkan", "cuda", ...
    # the device model ("" on the CPU), its type (cpu, gpu, igpu, accel) and driver, whether it
    # is a software implementation (lavapipe: its lanes are never hardware lanes), and the kind
    # stages compare (dgr.protocol.settings.compute_kind)
    device: str = ""
    device_type: str = "cpu"
    device_driver: str = ""
    software_device: bool = False
    compute: str = "cpu"
    llama_cpp_commit: str
    patch_stack_hash: str          # dgr.vendor.Vendor().patch_stack_hash()
    dgr_version: str
    wire_format_version: int
    boundary_schema_version: int   # dgr.protocol.wire.SCHEMA_VERSION
    boundary_width: int            # floats per token at the boundary (every residual stream)
    boundary_dtype: str            # "f32" (what "raw" carries)
    settings: dict[str, Any]       # numeric engine settings (protocol.settings.NUMERIC_SETTINGS)
    stage_identity: str            # what Forward.model must carry
    cpu_isa: list[str]             # ISA flags that select compute kernels (certify compares them)
    #: the build's CPU code: native (this CPU's ISA), x86-64-v3 (a portable wheel's), custom;
    #: and what ggml's CPU backend compiled (AVX2, F16C, ...): a lane is certified per variant
    cpu_variant: str = "native"
    cpu_compiled: list[str] = []


class Capacity(msgspec.Struct, kw_only=True):
    n_layer: int
    layer_start: int               # owned range [layer_start, layer_end)
    layer_end: int
    is_first: bool
    is_last: bool
    slots_total: int
    slots_free: int
    context_tokens_total: int      # slots_total * n_ctx
    context_tokens_free: int
    memory_bytes: int              # weights + KV cache of the owned range
    weight_bytes: int
    kv_bytes: int
    rss_bytes: int                 # resident set of the process (0 where unknown)
    # the compute device's memory (bytes): free and total as it reported them when the worker
    # loaded its range, and what this stage holds in its own buffers (on the CPU: the figures
    # above)
    device_memory_free: int = 0
    device_memory_total: int = 0
    device_weight_bytes: int = 0
    device_kv_bytes: int = 0
    device_compute_bytes: int = 0
    # what one more session costs, to size stages by both: the KV bytes per context token of
    # the owned attention layers (kv_bytes less the recurrent state, over every slot's cells),
    # and a recurrent or hybrid model's state bytes per session (its own layers' conv/SSM
    # rows; 0 for others), with the host bytes of each state snapshot it keeps per session
    # (state_snapshots of them: a prompt cache's restore points)
    kv_bytes_per_token: float = 0.0
    state_bytes_per_session: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0    # held now, every session's
    # context tokens per session (context_tokens_total over slots_total): --ctx as set, or what
    # the stage chose for --ctx 0 (its trained context within its KV budget), and that trained
    # context (0 where unknown)
    context_tokens_per_session: int = 0
    n_ctx_train: int = 0


class Load(msgspec.Struct, kw_only=True):
    queue_depth: int               # steps admitted and waiting for the engine
    in_flight_steps: int           # steps admitted and not yet answered (waiting + computing)
    sessions: int
    tokens_per_s: float            # tokens computed per wall second over the window
    window_s: float


class Seam(msgspec.Struct, kw_only=True):
    accepts: str                   # "tokens" (first stage) or "boundary"
    boundary_bytes_per_token: dict[str, int]  # incoming, per codec accepted (empty: tokens)
    output_bytes_per_token: dict[str, int]    # outgoing boundary per codec (empty: last stage)
    hop_latency_ms_p50: float      # frame arrival -> reply ready at this worker, 1-token steps
    hop_latency_ms_p99: float
    hop_samples: int
    compute_ms_avg: float          # moving average of the engine's 1-token step time


class Health(msgspec.Struct, kw_only=True):
    uptime_s: float
    draining: bool
    steps_served: int
    steps_failed: int              # refused or failed steps (ErrorReply frames)
    last_error: str                # "" when none
    last_error_age_s: float        # -1 when none


class PrefixStore(msgspec.Struct, kw_only=True):
    """The stage's prefix store (``Describe.prefix_store``): a tracker routes a tenant's
    requests where their prefixes are kept (prefix affinity)."""

    size: int                      # entries it may hold (0: none)
    entries: int
    positions: int                 # positions they hold, summed
    bytes: int                     # the KV cache those positions fill
    hits: int                      # sessions that adopted an entry
    misses: int                    # and that found none
    evictions: int                 # entries dropped for a slot, by age, or replaced


class LaneRef(msgspec.Struct, kw_only=True):
    lane_id: str
    backend: str = "cpu"
    device: str = ""               # the device model the lane was certified on ("" on the CPU)
    software_device: bool = False  # certified on a software device (lavapipe), not on hardware
    codec: str
    stages: list[list[int]]
    quantisation: str
    certified_at: str
    parity: dict[str, Any]         # the measured figures (see dgr.control.certificates.Parity)
    record: str                    # file name in the certification store


class Uncertified(msgspec.Struct, kw_only=True):
    lane_id: str
    codec: str
    stages: list[list[int]]
    record: str
    reasons: list[str]


class LayerTimes(msgspec.Struct, kw_only=True):
    """Each layer's time measured on this worker's machine and device, with its settings
    (``python -m dgr layer-costs``, ``dgr.control.layercost``): what a tracker balances a
    route's ranges by, each machine by its own figures."""

    batch: int                     # rows per forward (decode steps of this many sessions)
    context: int                   # tokens in each slot before the timed steps
    layer_ms: list[float]          # every layer of the model, ms per forward: layer 0's with
                                   # the embedding, the last's with the output head
    overhead_ms: float             # what a forward costs whatever its layers
    # a stage of layers [a, b) costs sum(layer_ms[a:b]) + overhead_ms per forward


class Capability(msgspec.Struct, kw_only=True):
    schema: int = SCHEMA
    endpoint: str = ""
    compatibility: Compatibility
    capacity: Capacity
    load: Load
    seam: Seam
    health: Health
    #: None: a worker older than the store, or a record made without a worker
    prefix_store: Optional[PrefixStore] = None
    cert_store: Optional[str] = None
    lanes: list[LaneRef] = []
    uncertified: list[Uncertified] = []
    #: this machine's measured layer times for the model and these settings, by batch (empty:
    #: never measured here)
    layer_times: list[LayerTimes] = []


def encode(rec: Capability) -> bytes:
    return msgspec.json.encode(rec)


def decode(data: bytes | str) -> Capability:
    return msgspec.json.decode(data, type=Capability)
