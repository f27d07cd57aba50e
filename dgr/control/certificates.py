"""The certification store: lane records, and matching them exactly against a worker.

A lane is (backend, model identity, recipe: quantisation, boundary codec, numeric engine
settings, stage layout). ``python -m dgr certify`` (``dgr.cli.certify``) measures a lane's parity
through real workers and writes a :class:`Certification` into the store: a directory of JSON
files, ``$DGR_CERT_STORE`` or ``$DGR_CACHE/certifications`` unless told otherwise. A worker
started with ``--cert-store`` advertises a lane only when the record matches it exactly (model
bytes, llama.cpp commit, patch-stack hash, settings, boundary schema, backend, CPU ISA, and its
range is a stage of the layout); any other record is reported as uncertified with the reasons.
Compiling a backend is not certifying it: there is no lane without a record.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import msgspec

from dgr.protocol.capability import LaneRef, Uncertified

__all__ = ["Lane", "Parity", "StageCost", "Failover", "Scenario", "Batching", "Speculation",
           "PrefixCache", "Certification",
           "store_path",
           "lane_id", "load_store", "write", "mismatches", "match"]


class Lane(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    backend: str                   # the engines' device's backend: cpu, vulkan, cuda, ...
    model_identity: str
    model_name: str
    quantisation: str
    codec: str
    settings: dict[str, Any]
    stages: list[list[int]]
    # the device model ("" on the CPU), its type and driver; a software device (lavapipe) is
    # recorded as such: its lanes are never hardware lanes. Left out of the JSON (and so of
    # lane_id) when they are the CPU's defaults: a CPU lane keeps the id it had before them
    device: str = ""
    device_type: str = "cpu"
    driver: str = ""
    software_device: bool = False


class Parity(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    generated_tokens: int
    tokens_match: bool
    logits_rows: int
    logits_bit_identical: bool
    max_abs_diff: float
    top1_agreement: float
    criterion: str
    passed: bool


class StageCost(msgspec.Struct, kw_only=True):
    """One stage over the certified generation (None: no figure; ``Scenario.notes`` say why)."""

    layers: list[int]
    endpoint: str
    rss_bytes: int                    # VmRSS of its worker process after the generation (0: unread)
    decode_steps: int | None = None   # single-token steps its worker computed during it
    compute_ms: float | None = None   # their mean compute (the worker's exact totals), ms
    rtt_ms: float | None = None       # hop by hop: the driver's mean round trip per decode step
    hop_ms: float | None = None       # hop by hop: rtt_ms - compute_ms, the hop's transport


class Failover(msgspec.Struct, kw_only=True):
    """A stage killed during a second generation, and how the route went on."""

    stage: int                        # index of the killed stage (the middle one, n // 2)
    layers: list[int]
    killed: str                       # the primary's endpoint
    how: str                          # e.g. "SIGKILL after 8 of 16 tokens"
    spare: str                        # the spare worker's endpoint (a process started for it)
    replaced_by: str                  # the stage's endpoint once the generation ended
    path: str                         # the session's step path (dgr.cli.costs.step_path)
    recoveries: int                   # re-prefills the session counted
    generated_tokens: int
    tokens_match: bool                # the whole model's tokens
    logits_rows: int
    logits_bit_identical: bool        # recorded, not required (rows after a re-prefill)
    max_abs_diff: float
    criterion: str
    passed: bool


class Batching(msgspec.Struct, kw_only=True):
    """Whether a session's rows computed in one forward with other sessions' rows are its
    rows computed alone, on this build, model and settings (``dgr.control.batching.measure``
    on the whole model in the certifying process). When they are not, routes on the lane
    still batch for throughput, and their parity mode runs its steps alone (``Forward.solo``):
    a batched session's tokens may then differ from the whole model's."""

    sessions: int
    decode_steps: int
    rows: int
    bit_identical: bool
    max_abs_diff: float
    top1_agreement: float
    parity_mode: str = "solo steps (Forward.solo): the whole model's rows, bit for bit"


class Speculation(msgspec.Struct, kw_only=True):
    """Whether a speculative trip's rows (``max_draft + 1`` tokens in one step, the rejected
    ones rolled back) are plain decoding's single-token rows, on this build, model and
    settings (``dgr.control.speculation.measure`` on the whole model in the certifying
    process). Bit-identical: speculation makes plain decoding's tokens on the lane. Not:
    its tokens agree with plain decoding's up to the rows' near ties (``top1_agreement``)."""

    max_draft: int
    trips: int
    rows: int
    bit_identical: bool
    max_abs_diff: float
    top1_agreement: float


class PrefixCache(msgspec.Struct, kw_only=True):
    """Whether a prompt served from a kept session (the front's prompt cache: a chat's next
    turn, ``RouteSession.reusable`` positions kept, the rest prefilled) gives the rows and
    tokens the same prompt gives prefilled fresh, through the lane's own workers. Each
    stage's own measurements decide how much a route keeps (``partial_rows_exact``: rows of
    a partial prefill chunk; ``decoded_rows_exact``: rows computed one per step, a reply's;
    with neither, whole chunks only): this is the route-level check that the rule holds."""

    prompt_tokens: int                # the next turn's prompt
    kept_positions: int               # of them served from the kept session's caches
    generated_tokens: int
    tokens_match: bool
    logits_rows: int
    bit_identical: bool
    max_abs_diff: float
    partial_rows_exact: list[bool]    # per stage (Describe.prefix_rows_exact)
    decoded_rows_exact: list[bool]    # per stage (Describe.prefix_single_rows_exact)
    #: per stage (Describe.prefix_chunk_rows_exact; empty in a record from before it)
    chunk_rows_exact: list[bool] = []


class Scenario(msgspec.Struct, kw_only=True):
    """How a lane was certified, and what its certified generation cost per stage and seam."""

    workers: str                      # how the stages ran, e.g. "processes on loopback"
    stages: int
    path: str                         # step path: "hop-by-hop", "relay" or "relay+loop"
    decode_tokens: int                # tokens timed (those after the first)
    decode_ms_per_token: float | None
    links: int                        # transport links a decode token crosses
    transport_ms_per_token: float | None
    seam_ms: float | None             # transport_ms_per_token / links
    costs: list[StageCost]
    notes: list[str] = []             # why a figure is missing
    failover: Failover | None = None  # None: no failover exercised


class Certification(msgspec.Struct, kw_only=True):
    schema: int = 1
    lane_id: str
    lane: Lane
    llama_cpp_commit: str
    patch_stack_hash: str
    wire_schema_version: int
    cpu_model: str
    cpu_isa: list[str]
    cpu_flags: list[str]
    parity: Parity
    certified_at: str          # ISO 8601, UTC
    dgr_version: str
    seconds: float
    arch: str = ""             # the model's architecture ("": a record from before it was kept)
    #: how it was certified (None: a record from before scenarios were kept); not in the lane
    scenario: Scenario | None = None
    #: batched against alone (None: a record from before batching was measured)
    batching: Batching | None = None
    #: speculative trips against single-token steps (None: a record from before it was
    #: measured)
    speculation: Speculation | None = None
    #: a kept session's next turn against a fresh prefill (None: a record from before it was
    #: measured)
    prefix_cache: PrefixCache | None = None
    #: the most positions the lane's stages roll back (``Describe.rollback_window``): 0 for a
    #: recurrent or hybrid model, whose lane measures no speculation (a route refuses it
    #: there) and reuses no kept prefix; -1 no limit (or a record from before it was kept)
    rollback_window: int = -1
    #: the build's CPU variant (``dgr.control.capability.cpu_variant``): variants run other
    #: kernels, so one's lane does not certify another's ("native": a record from before)
    cpu_variant: str = "native"


def store_path(path: str | os.PathLike | None = None) -> Path:
    """The certification store: ``path``, else ``$DGR_CERT_STORE``, else under ``$DGR_CACHE``."""
    if path:
        return Path(path)
    env = os.environ.get("DGR_CERT_STORE")
    if env:
        return Path(env)
    from dgr.vendor import cache_root

    return cache_root() / "certifications"


def lane_id(lane: Lane) -> str:
    return hashlib.sha256(msgspec.json.encode(lane, order="sorted")).hexdigest()[:16]


def _build_key(c: Certification) -> str:
    parts = [c.llama_cpp_commit, c.patch_stack_hash, str(c.wire_schema_version),
             " ".join(c.cpu_isa)]
    if c.cpu_variant != "native":  # a native record's key is what it was before variants
        parts.append(c.cpu_variant)
    h = hashlib.sha256("\0".join(parts).encode())
    return h.hexdigest()[:12]


def load_store(path: str | os.PathLike | None = None) -> list[tuple[str, Certification]]:
    """Every readable record in the store, as ``(file name, record)``, sorted by file name.

    Unreadable or malformed files are skipped (they certify nothing).
    """
    d = store_path(path)
    out = []
    try:
        names = sorted(p for p in os.listdir(d) if p.endswith(".json"))
    except OSError:
        return []
    for name in names:
        try:
            out.append((name, msgspec.json.decode((d / name).read_bytes(), type=Certification)))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out


def write(rec: Certification, path: str | os.PathLike | None = None) -> Path:
    d = store_path(path)
    d.mkdir(parents=True, exist_ok=True)
    dest = d / f"{rec.lane_id}-{_build_key(rec)}.json"
    tmp = dest.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(rec), indent=2) + b"\n")
    tmp.replace(dest)
    return dest


def mismatches(rec: Certification, comp, layers: Sequence[int]) -> list[str]:
    """Why ``rec`` does not certify a worker with compatibility ``comp`` over ``layers``."""
    why = []
    lane = rec.lane
    if not rec.parity.passed:
        why.append("the parity suite did not pass")
    if lane.backend != comp.backend:
        why.append(f"backend {lane.backend} != {comp.backend}")
    if lane.device != getattr(comp, "device", ""):
        why.append(f"device {lane.device or 'cpu'!r} != {getattr(comp, 'device', '') or 'cpu'!r}")
    if lane.driver != getattr(comp, "device_driver", ""):
        why.append(f"driver {lane.driver!r} != {getattr(comp, 'device_driver', '')!r}")
    if lane.model_identity != comp.model_identity:
        why.append(f"model identity {lane.model_identity} != {comp.model_identity}")
    if rec.llama_cpp_commit != comp.llama_cpp_commit:
        why.append(f"llama.cpp commit {rec.llama_cpp_commit[:12]} != "
                   f"{comp.llama_cpp_commit[:12]}")
    if rec.patch_stack_hash != comp.patch_stack_hash:
        why.append(f"patch-stack hash {rec.patch_stack_hash[:12]} != "
                   f"{comp.patch_stack_hash[:12]}")
    if rec.wire_schema_version != comp.boundary_schema_version:
        why.append(f"boundary schema {rec.wire_schema_version} != "
                   f"{comp.boundary_schema_version}")
    for k in sorted(set(lane.settings) | set(comp.settings)):
        a, b = lane.settings.get(k), comp.settings.get(k)
        if a != b:
            why.append(f"setting {k}={a!r} != {b!r}")
    if list(rec.cpu_isa) != list(comp.cpu_isa):
        why.append("CPU ISA flags differ: "
                   + " ".join(sorted(set(rec.cpu_isa) ^ set(comp.cpu_isa))))
    if rec.cpu_variant != getattr(comp, "cpu_variant", "native"):
        why.append(f"CPU variant {rec.cpu_variant} != {getattr(comp, 'cpu_variant', 'native')}")
    if len(lane.stages) > 1 and not getattr(comp, "arch_splittable", False):
        why.append(f"architecture {comp.arch} does not split in this build (its graph does not "
                   "honour a layer range: docs/architectures.md)")
    if [int(layers[0]), int(layers[1])] not in [list(s) for s in lane.stages]:
        why.append(f"layers [{layers[0]}, {layers[1]}) are not a stage of "
                   f"{[tuple(s) for s in lane.stages]}")
    return why


def match(path, comp, layers: Sequence[int]) -> tuple[list, list]:
    """(lanes a worker may advertise, uncertified lanes with reasons) from the store."""
    lanes, other = [], []
    for name, rec in load_store(path):
        stages = [list(s) for s in rec.lane.stages]
        why = mismatches(rec, comp, layers)
        if why:
            other.append(Uncertified(lane_id=rec.lane_id, codec=rec.lane.codec, stages=stages,
                                     record=name, reasons=why))
        else:
            lanes.append(LaneRef(lane_id=rec.lane_id, backend=rec.lane.backend,
                                 device=rec.lane.device, software_device=rec.lane.software_device,
                                 codec=rec.lane.codec, stages=stages,
                                 quantisation=rec.lane.quantisation,
                                 certified_at=rec.certified_at,
                                 parity=msgspec.to_builtins(rec.parity), record=name))
    return lanes, other
