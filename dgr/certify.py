"""Certification lanes: parity measured through real workers, recorded, and matched exactly.

A lane is (backend, model identity, recipe: quantisation, boundary codec, numeric engine
settings, stage layout). ``python -m dgr certify`` starts one ``python -m dgr.worker`` per stage
on loopback, generates through them with the lane's codec, compares every sampled token and
logits row with the whole model in this process (same settings), and, when the lane passes,
writes a :class:`Certification` into the certification store: a directory of JSON files,
``$DGR_CERT_STORE`` or ``$DGR_CACHE/certifications`` unless told otherwise. A worker started
with ``--cert-store`` advertises a lane only when the record matches it exactly (model bytes,
llama.cpp commit, patch-stack hash, settings, boundary schema, backend, CPU ISA, and its range
is a stage of the layout); any other record is reported as uncertified with the reasons.
Compiling a backend is not certifying it: there is no lane without a record.

Pass criterion: codec ``raw`` needs the same tokens and bit-identical logits rows; a lossy
codec needs the same tokens (top-1 agreement 1.0); the measured max |diff| is recorded.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import msgspec
import numpy as np

from . import wire

__all__ = ["Lane", "Parity", "Certification", "store_path", "lane_id", "load_store",
           "match", "certify", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Explain why the sky is blue."


class Lane(msgspec.Struct, kw_only=True, frozen=True):
    backend: str
    model_identity: str
    model_name: str
    quantisation: str
    codec: str
    settings: dict[str, Any]
    stages: list[list[int]]


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


def store_path(path: str | os.PathLike | None = None) -> Path:
    """The certification store: ``path``, else ``$DGR_CERT_STORE``, else under ``$DGR_CACHE``."""
    if path:
        return Path(path)
    env = os.environ.get("DGR_CERT_STORE")
    if env:
        return Path(env)
    from .vendor import cache_root

    return cache_root() / "certifications"


def lane_id(lane: Lane) -> str:
    return hashlib.sha256(msgspec.json.encode(lane, order="sorted")).hexdigest()[:16]


def _build_key(c: Certification) -> str:
    h = hashlib.sha256("\0".join([c.llama_cpp_commit, c.patch_stack_hash, str(
        c.wire_schema_version), " ".join(c.cpu_isa)]).encode())
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
    if [int(layers[0]), int(layers[1])] not in [list(s) for s in lane.stages]:
        why.append(f"layers [{layers[0]}, {layers[1]}) are not a stage of "
                   f"{[tuple(s) for s in lane.stages]}")
    return why


def match(path, comp, layers: Sequence[int]) -> tuple[list, list]:
    """(lanes a worker may advertise, uncertified lanes with reasons) from the store."""
    from .capability import LaneRef, Uncertified

    lanes, other = [], []
    for name, rec in load_store(path):
        stages = [list(s) for s in rec.lane.stages]
        why = mismatches(rec, comp, layers)
        if why:
            other.append(Uncertified(lane_id=rec.lane_id, codec=rec.lane.codec, stages=stages,
                                     record=name, reasons=why))
        else:
            lanes.append(LaneRef(lane_id=rec.lane_id, codec=rec.lane.codec, stages=stages,
                                 quantisation=rec.lane.quantisation,
                                 certified_at=rec.certified_at,
                                 parity=msgspec.to_builtins(rec.parity), record=name))
    return lanes, other


def certify(model: str | os.PathLike, ranges: Sequence[tuple[int, int]], *,
            codec: str = "raw", settings: dict | None = None, prompt: str = DEFAULT_PROMPT,
            max_tokens: int = 16, store: str | os.PathLike | None = None,
            start_timeout: float = 180.0, progress=None) -> tuple[Certification, Path | None]:
    """Run the lane's parity suite through worker processes; store the record if it passes.

    Returns the record and the file written (None when the lane did not pass).
    """
    import time

    from . import __version__, capability
    from .engine import Engine
    from .identity import model_identity
    from .route import Route, generate_local
    from .worker import LocalCluster

    if codec not in wire.CODECS:
        raise wire.UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(wire.CODECS)})")
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    model = os.fspath(model)
    whole = Engine(model, **(settings or {}))
    settings = dict(whole.settings)
    n_layer = whole.n_layer
    ranges = [(int(a), int(b)) for a, b in ranges]
    tokens = [int(t) for t in whole.tokenize(prompt, True, True)]
    say(f"whole model loaded; {len(ranges)} stage(s) "
        + " ".join(f"[{a},{b})" for a, b in ranges) + f", codec {codec}")
    ref, ref_rows = generate_local(whole, tokens, max_tokens=max_tokens, logits=True)
    cluster = LocalCluster(model, [None if r == (0, n_layer) else r for r in ranges],
                           settings=settings)
    try:
        endpoints = cluster.start(timeout=start_timeout)
        say("workers listening on " + ",".join(endpoints))
        with Route(endpoints, tokenizer=whole, codec=codec) as route:
            session = route.session()
            got = list(session.generate(tokens, max_tokens=max_tokens, logits=True))
            rows = list(session.logits)
            session.close()
    finally:
        cluster.stop()
    n = min(len(rows), len(ref_rows))
    bits = n == len(ref_rows) == len(rows) and all(
        a.tobytes() == b.tobytes() for a, b in zip(ref_rows, rows))
    diff = max((float(np.max(np.abs(a.astype(np.float64) - b)))
                for a, b in zip(ref_rows, rows)), default=0.0)
    top1 = (float(np.mean([int(np.argmax(a)) == int(np.argmax(b))
                           for a, b in zip(ref_rows, rows)])) if n else 0.0)
    same = got == ref
    if codec == "raw":
        criterion, passed = "same tokens and bit-identical logits rows", same and bits
    else:
        criterion, passed = "same tokens (top-1 agreement 1.0)", same and top1 == 1.0
    par = Parity(prompt_tokens=len(tokens), generated_tokens=len(got), tokens_match=same,
                 logits_rows=n, logits_bit_identical=bits, max_abs_diff=diff,
                 top1_agreement=top1, criterion=criterion, passed=passed)
    bi = capability.build_info()
    cpu_model, flags, isa = capability.cpu_features()
    lane = Lane(backend=bi["backend"], model_identity=model_identity(model),
                model_name=os.path.basename(model), quantisation=capability.quantisation(model),
                codec=codec, settings=settings, stages=[[a, b] for a, b in ranges])
    rec = Certification(
        lane_id=lane_id(lane), lane=lane, llama_cpp_commit=bi["llama_cpp_commit"],
        patch_stack_hash=bi["patch_stack_hash"], wire_schema_version=wire.SCHEMA_VERSION,
        cpu_model=cpu_model, cpu_isa=list(isa), cpu_flags=list(flags), parity=par,
        certified_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        dgr_version=__version__, seconds=round(time.monotonic() - t0, 3))
    return rec, (write(rec, store) if passed else None)


# -- command line (registered in dgr.cli) ----------------------------------------------------

def add_certify_parser(sub, add_engine_args) -> None:
    c = sub.add_parser(
        "certify", help="run the parity suite for a lane through workers; record it if it passes",
        description="Certify a lane (backend, model, quantisation, boundary codec, engine "
                    "settings, stage layout): start one worker process per stage on loopback, "
                    "generate through them and compare every token and logits row with the "
                    "whole model here. A passing lane is written to the certification store "
                    "($DGR_CERT_STORE, default $DGR_CACHE/certifications); workers started "
                    "with --cert-store advertise it only while their model, build and settings "
                    "match the record exactly.")
    c.add_argument("--model", help="GGUF path (default: the registry's default model)")
    c.add_argument("--stages", type=int, default=2, help="even split into N stages (default 2)")
    c.add_argument("--splits", help="interior split layers, e.g. 10,20 (overrides --stages)")
    c.add_argument("--codec", default="raw", choices=list(wire.CODECS))
    c.add_argument("--prompt", default=DEFAULT_PROMPT)
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument("--store", help="certification store directory")
    c.add_argument("--start-timeout", type=float, default=180.0)
    c.add_argument("--type-k", default="f16")
    c.add_argument("--type-v", default="f16")
    add_engine_args(c)
    c.set_defaults(func=_cmd_certify)
    ls = sub.add_parser("lanes", help="list the certification store's lanes",
                        description="List the certified lanes in the store, and whether each "
                                    "matches this build (llama.cpp commit, patch stack, CPU).")
    ls.add_argument("--store", help="certification store directory")
    ls.add_argument("--json", action="store_true", help="print the records as JSON lines")
    ls.set_defaults(func=_cmd_lanes)


def _cmd_certify(args) -> int:
    import sys

    from . import errors, models
    from .chain import parse_splits, split_layers
    from .engine import Engine

    def say(msg):
        print(f"[dgr] {msg}", file=sys.stderr, flush=True)

    try:
        model = args.model or str(models.path(models.DEFAULT_MODEL))
        settings = dict(n_ctx=args.ctx, n_slots=args.slots, n_threads=args.threads,
                        n_ubatch=args.ubatch, flash_attn=args.flash_attn == "on",
                        type_k=args.type_k, type_v=args.type_v)
        n_layer = Engine(model, n_ctx=64).n_layer
        ranges = (parse_splits([int(x) for x in args.splits.split(",")], n_layer)
                  if args.splits else split_layers(n_layer, args.stages))
        rec, path = certify(model, ranges, codec=args.codec, settings=settings,
                            prompt=args.prompt, max_tokens=args.max_tokens, store=args.store,
                            start_timeout=args.start_timeout, progress=say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except errors.DgrError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    p = rec.parity
    say(f"lane {rec.lane_id}: {p.generated_tokens} tokens, tokens match {p.tokens_match}, "
        f"logits bit-identical {p.logits_bit_identical} over {p.logits_rows} rows, "
        f"max|diff| {p.max_abs_diff:.3g}, top-1 {p.top1_agreement:.3f} ({p.criterion})")
    if path is None:
        say("NOT certified: the parity suite failed; nothing written")
        return 1
    say(f"certified; record {path}")
    print(path)
    return 0


def _cmd_lanes(args) -> int:
    from . import capability

    bi = capability.build_info()
    _, _, isa = capability.cpu_features()
    recs = load_store(args.store)
    if args.json:
        for _, rec in recs:
            print(msgspec.json.encode(rec).decode())
        return 0
    print(f"store {store_path(args.store)}: {len(recs)} record(s); this build: llama.cpp "
          f"{bi['llama_cpp_commit'][:12]}, patches {bi['patch_stack_hash'][:12]}")
    for name, rec in recs:
        lane = rec.lane
        build_ok = (rec.llama_cpp_commit == bi["llama_cpp_commit"]
                    and rec.patch_stack_hash == bi["patch_stack_hash"]
                    and list(rec.cpu_isa) == list(isa))
        s = lane.settings
        print(f"{rec.lane_id}  {lane.backend}  {lane.model_name} ({lane.model_identity[:19]})  "
              f"{lane.quantisation}  codec={lane.codec}  stages="
              + ",".join(f"[{a},{b})" for a, b in lane.stages)
              + f"  ctx{s.get('n_ctx')} slots{s.get('n_slots')} t{s.get('n_threads')} "
                f"ub{s.get('n_ubatch')} fa{int(bool(s.get('flash_attn')))} "
                f"k{s.get('type_k')} v{s.get('type_v')}  "
                f"{'passed' if rec.parity.passed else 'FAILED'}  {rec.certified_at}  "
                f"{'this build' if build_ok else 'OTHER BUILD'}")
    return 0
