"""The capability record: what a worker tells an external tracker (docs/capability.md).

:func:`record_for` builds it (schema: ``dgr.protocol.capability``) in-process from an engine
and, when given, the live counters of a worker's step pipeline
(``dgr.worker.pipeline.StagePipeline``); a worker serves it as JSON in
``DescribeReply.capability_json``, and ``ShardClient.capability()`` decodes it. The record is
*inputs*, not a routing decision: exact compatibility, range and capacity, queue and load,
seam cost, health, and the certified lanes (``dgr.control.certificates``) whose records match
this worker exactly. A lane whose record does not match (another llama.cpp commit, patch
stack, engine setting, model bytes, CPU ISA) is listed under ``uncertified`` with the
reasons, never under ``lanes``.
"""

from __future__ import annotations

import functools
import json
import os
import time

from dgr._core import arch_supports_layer_range
from dgr.control import certificates
from dgr.protocol import wire
from dgr.protocol.capability import (
    Capability,
    Capacity,
    Compatibility,
    Health,
    LayerTimes,
    Load,
    PrefixStore,
    Seam,
)
from dgr.vendor import cpu_features  # one reader of the host's ISA (the build key's too)

__all__ = ["build_info", "quantisation", "cpu_features", "cpu_variant", "record_for"]


# -- build and host facts -------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _vendor_facts() -> tuple[str, str]:
    # What the compiled core was built against, not what patches/ holds now: a changed patch
    # without a rebuild must not make a worker claim the new stack.
    from dgr._core import BUILD_INFO

    return BUILD_INFO["llama_cpp_commit"], BUILD_INFO["patch_stack_hash"]


@functools.lru_cache(maxsize=1)
def cpu_variant() -> tuple[str, tuple[str, ...]]:
    """The CPU code this process computes with: the build's variant (``native``,
    ``x86-64-v3``, ``custom``: ``dgr.vendor.CPU_VARIANTS``) and what ggml's CPU backend was
    compiled for (``AVX2``, ``F16C``, ``OPENMP``, ...). Variants may differ in bits."""
    from dgr._core import BUILD_INFO, cpu_features as compiled

    return BUILD_INFO.get("cpu_variant", "native"), tuple(compiled())


def build_info() -> dict[str, str]:
    """The build this process computes with: llama.cpp commit, patch-stack hash, the ggml
    backends it carries (``backends``, comma-separated registry names: ``CPU, Vulkan, RPC``)
    and its CPU code (``cpu_variant``, ``cpu_compiled``: :func:`cpu_variant`).
    Which backend a record names is its engine's device's (:func:`device_of`)."""
    from dgr._core import backends

    commit, patches = _vendor_facts()
    variant, compiled = cpu_variant()
    return {"llama_cpp_commit": commit, "patch_stack_hash": patches,
            "backends": ", ".join(backends()), "cpu_variant": variant,
            "cpu_compiled": " ".join(compiled)}


def _facts(engine, pipeline=None) -> dict | None:
    """``Engine.compute_facts()``: a worker's copy read at its start (reading the engine's
    again waits for a running compute), else the engine's; None for an engine without
    devices (a test double)."""
    if pipeline is not None:
        return pipeline.engine_device
    facts = getattr(engine, "compute_facts", None)
    return facts() if facts is not None else None


def device_of(engine, pipeline=None) -> dict:
    """The compute device of ``engine`` as records name it: ``backend`` (``cpu``, ``vulkan``,
    ...), ``device`` (the model; "" on the CPU), ``device_type``, ``driver``, ``software``
    and ``compute`` (the kind stages compare), from the engine itself (``pipeline``'s copy
    when given)."""
    f = _facts(engine, pipeline)
    if f is None:  # an engine without devices: the CPU
        return {"backend": "cpu", "device": "", "device_type": "cpu", "driver": "",
                "software": False, "compute": "cpu"}
    cpu = f["type"] == "cpu"
    return {"backend": f["backend"], "device": "" if cpu else f["description"],
            "device_type": f["type"], "driver": f["driver"], "software": bool(f["software"]),
            "compute": f["kind"]}


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
               15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
               20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
               25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS",
               31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


@functools.lru_cache(maxsize=64)
def _quantisation(path: str, size: int, mtime: int) -> str:
    from dgr.artifacts import gguf as gguf_io

    try:
        head = gguf_io.read_header(path, decode_arrays=False)
    except Exception:  # noqa: BLE001
        return "unknown"
    ft = head.kv.get("general.file_type")
    if isinstance(ft, int):
        return _FILE_TYPES.get(ft, f"file_type_{ft}")
    counts: dict[str, int] = {}
    for t in head.tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + t.nbytes
    return max(counts, key=counts.get).upper() if counts else "unknown"


def quantisation(path: str | os.PathLike) -> str:
    """The model's quantisation: GGUF ``general.file_type`` (else the dominant tensor type)."""
    try:
        st = os.stat(path)
    except OSError:
        return "unknown"
    return _quantisation(os.fspath(path), st.st_size, st.st_mtime_ns)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


def _per_session(info: dict, n_slots: int, n_ctx: int) -> dict:
    """The capacity a session takes: KV bytes per context token (the recurrent state set
    apart) and a recurrent state's bytes per session, with its snapshots'."""
    state = int(info.get("state_bytes", 0))
    cells = n_slots * n_ctx
    kv = max(int(info["kv_bytes"]) - state * n_slots, 0)
    return {"kv_bytes_per_token": kv / cells if cells else 0.0,
            "state_bytes_per_session": state,
            "state_snapshots": int(info.get("state_snapshots", 0)),
            "state_snapshot_bytes": int(info.get("state_snapshot_bytes", 0))}


def _device_memory(engine, pipeline, weight: int, kv: int) -> dict[str, int]:
    f = _facts(engine, pipeline)
    if f is None:
        return {"device_weight_bytes": weight, "device_kv_bytes": kv}
    return {"device_memory_free": int(f["memory_free"]), "device_memory_total": int(f["memory_total"]),
            "device_weight_bytes": int(f["weight_bytes"]), "device_kv_bytes": int(f["kv_bytes"]),
            "device_compute_bytes": int(f["compute_bytes"])}


# -- the record -----------------------------------------------------------------------------

def record_for(engine, *, pipeline=None, cert_store: str | os.PathLike | None = None,
               endpoint: str = "") -> Capability:
    """The capability record of ``engine`` (a ``dgr.Engine``), with the live figures of
    ``pipeline`` (a worker's ``dgr.worker.pipeline.StagePipeline``) and its ``endpoint``.

    Without ``pipeline`` the record describes an idle engine (all slots free, no load). With
    ``cert_store`` the store's lanes are matched against this engine and build
    (``dgr.control.certificates.match``): matches go to ``lanes``, the others to ``uncertified``.
    """
    from dgr import __version__
    from dgr.protocol.settings import canonical, stage_identity

    info = pipeline.info if pipeline is not None else engine.describe()
    settings = canonical(engine.settings)
    bi = build_info()
    dev = device_of(engine, pipeline)
    _, _, isa = cpu_features()
    width = int(engine.n_embd_boundary)
    layers = tuple(int(x) for x in engine.layers)
    is_first, is_last = bool(engine.is_first), bool(engine.is_last)
    n_slots = int(settings["n_slots"])
    n_ctx = int(pipeline.n_ctx if pipeline is not None else getattr(engine, "n_ctx", 0)
                or settings["n_ctx"])
    model_path = info["model"]
    comp = Compatibility(
        model_identity=info["identity"], model_name=os.path.basename(model_path),
        arch=info["arch"], arch_splittable=bool(arch_supports_layer_range(info["arch"])),
        quantisation=quantisation(model_path), backend=dev["backend"], device=dev["device"],
        device_type=dev["device_type"], device_driver=dev["driver"],
        software_device=dev["software"], compute=dev["compute"],
        llama_cpp_commit=bi["llama_cpp_commit"], patch_stack_hash=bi["patch_stack_hash"],
        dgr_version=__version__, wire_format_version=wire.FORMAT_VERSION,
        boundary_schema_version=wire.SCHEMA_VERSION, boundary_width=width,
        boundary_dtype="f32", settings=settings,
        stage_identity=stage_identity(info["identity"], settings, dev["compute"]),
        cpu_isa=list(isa), cpu_variant=bi["cpu_variant"], cpu_compiled=bi["cpu_compiled"].split())
    weight, kv = int(info["weight_bytes"]), int(info["kv_bytes"])
    if pipeline is not None:
        table = pipeline.table
        with pipeline.lock:  # the table's lock: data-plane threads insert sessions meanwhile
            slots_free, sessions = int(table.free_slots), len(table)
            ctx_free = max(int(table.free_context), 0)
        inflight, computing = int(pipeline.inflight), int(pipeline.computing)
        tps, span = pipeline.window.tokens_per_s(), pipeline.window.span
        hops = list(pipeline.hop_ms)
        health = Health(
            uptime_s=time.monotonic() - pipeline.started, draining=bool(pipeline.draining),
            steps_served=int(pipeline.steps_total), steps_failed=int(pipeline.errors_total),
            last_error=pipeline.last_error,
            last_error_age_s=(time.monotonic() - pipeline.last_error_at
                              if pipeline.last_error_at else -1.0))
        compute_ms = float(pipeline.window.decode_ms)
    else:
        slots_free, sessions, ctx_free = n_slots, 0, n_slots * n_ctx
        inflight = computing = 0
        tps, span, hops, compute_ms = 0.0, 10.0, [], 0.0
        health = Health(uptime_s=0.0, draining=False, steps_served=0, steps_failed=0,
                        last_error="", last_error_age_s=-1.0)
    cap = Capacity(
        n_layer=int(info["n_layer"]), layer_start=layers[0], layer_end=layers[1],
        is_first=is_first, is_last=is_last, slots_total=n_slots, slots_free=slots_free,
        context_tokens_total=n_slots * n_ctx, context_tokens_free=ctx_free,
        context_tokens_per_session=n_ctx, n_ctx_train=int(info.get("n_ctx_train", 0)),
        memory_bytes=weight + kv, weight_bytes=weight, kv_bytes=kv, rss_bytes=_rss_bytes(),
        **_device_memory(engine, pipeline, weight, kv), **_per_session(info, n_slots, n_ctx))
    load = Load(queue_depth=max(inflight - computing, 0), in_flight_steps=inflight,
                sessions=sessions, tokens_per_s=float(tps), window_s=float(span))
    per_codec = {c: wire.payload_size(c, 1, width) for c in wire.CODECS}
    if is_last:
        out: dict[str, int] = {}
    elif is_first:  # a first stage answers token input with a raw boundary
        out = {"raw": per_codec["raw"]}
    else:
        out = dict(per_codec)
    seam = Seam(accepts="tokens" if is_first else "boundary",
                boundary_bytes_per_token={} if is_first else dict(per_codec),
                output_bytes_per_token=out,
                hop_latency_ms_p50=_percentile(hops, 50), hop_latency_ms_p99=_percentile(hops, 99),
                hop_samples=len(hops), compute_ms_avg=compute_ms)
    rec = Capability(endpoint=endpoint, compatibility=comp, capacity=cap, load=load, seam=seam,
                     health=health)
    if pipeline is not None:
        rec.prefix_store = PrefixStore(**pipeline.slots.prefix_store())
    if cert_store is not None:
        rec.cert_store = os.fspath(cert_store)
        rec.lanes, rec.uncertified = certificates.match(cert_store, comp, layers)
    rec.layer_times = layer_times(model_path, {**engine.settings, "device": engine.device})
    return rec


def layer_times(model: str, settings: dict) -> list[LayerTimes]:
    """This machine's measured layer times of ``model`` with ``settings``, by batch (read
    again only when the measurements' folder or the model file changes)."""
    from dgr.control.layercost import key_settings
    from dgr.vendor import cache_root

    def mtime(p) -> int:
        try:
            return os.stat(p).st_mtime_ns
        except OSError:
            return 0

    folder = cache_root() / "layer-costs"
    try:  # the files too: two writes within one tick of the file system's clock
        files = len(os.listdir(folder))
    except OSError:
        files = 0
    key = json.dumps(key_settings(settings), sort_keys=True)
    return list(_layer_times(model, key, mtime(model), mtime(folder), files))


@functools.lru_cache(maxsize=64)
def _layer_times(model: str, settings: str, _model_mtime: int, _dir_mtime: int, _files: int
                 ) -> tuple[LayerTimes, ...]:
    from dgr.control import layercost

    got = layercost.cached(model, json.loads(settings))
    return tuple(LayerTimes(batch=c.batch, context=c.context, layer_ms=list(c.layer_ms),
                            overhead_ms=c.overhead_ms) for c in got)
