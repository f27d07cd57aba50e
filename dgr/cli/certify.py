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
import os
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from dgr.control.certificates import (
    Certification,
    Lane,
    Parity,
    lane_id,
    load_store,
    store_path,
    write,
)
from dgr.protocol import settings as engine_settings
from dgr.protocol import wire

__all__ = ["certify", "add_certify_parser", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Explain why the sky is blue."


def certify(model: str | os.PathLike, ranges: Sequence[tuple[int, int]], *,
            codec: str = "raw", settings: dict | None = None, prompt: str = DEFAULT_PROMPT,
            max_tokens: int = 16, store: str | os.PathLike | None = None,
            start_timeout: float = 180.0, progress=None) -> tuple[Certification, Path | None]:
    """Run the lane's parity suite through worker processes; store the record if it passes.

    Returns the record and the file written (None when the lane did not pass).
    """
    import time

    from dgr import __version__
    from dgr.artifacts.identity import model_identity
    from dgr.control import capability
    from dgr.core.engine import Engine
    from dgr.core.local import generate_local
    from dgr.driver.route import Route
    from dgr.worker.process import LocalCluster

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

def add_certify_parser(sub) -> None:
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
    engine_settings.add_arguments(c)
    c.set_defaults(func=_cmd_certify)
    ls = sub.add_parser("lanes", help="list the certification store's lanes",
                        description="List the certified lanes in the store, and whether each "
                                    "matches this build (llama.cpp commit, patch stack, CPU).")
    ls.add_argument("--store", help="certification store directory")
    ls.add_argument("--json", action="store_true", help="print the records as JSON lines")
    ls.set_defaults(func=_cmd_lanes)


def _cmd_certify(args) -> int:
    import sys

    from dgr import errors
    from dgr.artifacts import models
    from dgr.core.engine import Engine
    from dgr.protocol.ranges import ranges_for

    def say(msg):
        print(f"[dgr] {msg}", file=sys.stderr, flush=True)

    try:
        model = args.model or str(models.path(models.DEFAULT_MODEL))
        settings = engine_settings.from_args(args)
        n_layer = Engine(model, n_ctx=64).n_layer
        ranges = ranges_for(args.splits, args.stages, n_layer)
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
    from dgr.control import capability

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
