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
codec needs the same tokens (top-1 agreement 1.0); the measured max |diff| is recorded. With
``--failover`` (3+ stages) a spare worker serves the middle stage's range and a second
generation SIGKILLs the middle primary after half the tokens: it must still give the whole
model's tokens, with one recovery, on the spare. The record's ``scenario`` says how the lane
was certified (worker processes, stages, step path, the failover) and what the certified
generation cost: per stage its layers, endpoint, worker RSS, compute per decode step and, hop
by hop, the hop's transport; the decode ms/token and the mean cost per seam.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from dgr.control.certificates import (
    Batching,
    Certification,
    Failover,
    Lane,
    Parity,
    PrefixCache,
    Scenario,
    Speculation,
    StageCost,
    lane_id,
    load_store,
    store_path,
    write,
)
from dgr.protocol import settings as engine_settings
from dgr.protocol import wire

__all__ = ["certify", "add_certify_parser", "scenario_line", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Explain why the sky is blue."


def certify(model: str | os.PathLike, ranges: Sequence[tuple[int, int]], *,
            codec: str = "raw", settings: dict | None = None, prompt: str = DEFAULT_PROMPT,
            max_tokens: int = 16, store: str | os.PathLike | None = None,
            start_timeout: float = 180.0, failover: bool = False, relay: bool | None = None,
            progress=None) -> tuple[Certification, Path | None]:
    """Run the lane's parity suite through worker processes; store the record if it passes.

    ``failover``: also start a spare worker for the middle stage (index ``n // 2``, 3 or
    more stages) and run a second generation that SIGKILLs the middle primary after half the
    tokens; the lane then passes only if that generation still has the whole model's tokens,
    counted one recovery and ended with the spare serving the stage. The record's
    ``scenario`` says how the lane was certified and what each stage and seam cost.
    ``relay``: the route's direct relay (``dgr.driver.route.Route``; None: where it applies).
    Hop by hop (False) the scenario has each hop's cost (round trip minus compute); with
    relay, the transport per link only.

    Returns the record and the file written (None when the lane did not pass).
    """
    import time

    from dgr import __version__, errors
    from dgr.artifacts.identity import model_identity
    from dgr.cli.costs import route_costs
    from dgr.control import capability
    from dgr.core.engine import Engine
    from dgr.core.local import generate_local
    from dgr.driver.route import Route
    from dgr.worker.process import LocalCluster

    if codec not in wire.CODECS:
        raise wire.UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(wire.CODECS)})")
    ranges = [(int(a), int(b)) for a, b in ranges]
    n_stages = len(ranges)
    if failover and n_stages < 3:
        raise errors.InvalidArgument(
            f"a failover certification needs 3 or more stages (a middle stage with a "
            f"neighbour on each side), not {n_stages}")
    say = progress or (lambda msg: None)
    t0 = time.monotonic()
    model = os.fspath(model)
    whole = Engine(model, **(settings or {}))
    settings = dict(whole.settings)  # the lane's numeric settings
    on = {**settings, "device": whole.device}  # the workers' and measuring engines' too
    n_layer = whole.n_layer
    tokens = [int(t) for t in whole.tokenize(prompt, True, True)]
    mid = n_stages // 2
    say(f"whole model loaded; {n_stages} stage(s) "
        + " ".join(f"[{a},{b})" for a, b in ranges) + f", codec {codec}"
        + (f"; failover of stage {mid} [{ranges[mid][0]},{ranges[mid][1]}) onto a spare"
           if failover else ""))
    ref, ref_rows = generate_local(whole, tokens, max_tokens=max_tokens, logits=True)
    batching = _batching(model, whole, on, say)
    window = int(whole.describe().get("rollback_window", -1))
    if window == 0:  # a recurrent state rolls no rejected draft back: no trip to measure
        speculation = None
        say(f"speculative trips: {speculation_line(None, window)}")
    else:
        speculation = _speculation(whole, on, say)
    procs = [None if r == (0, n_layer) else r for r in ranges]
    cluster = LocalCluster(model, procs + ([procs[mid]] if failover else []),
                           settings=on)
    fo = None
    try:
        endpoints = cluster.start(timeout=start_timeout)
        primaries = endpoints[:n_stages]
        say("workers listening on " + ",".join(primaries)
            + (f"; spare for stage {mid} on {endpoints[-1]}" if failover else ""))
        with Route(primaries, tokenizer=whole, codec=codec, relay=relay) as route:
            before = route.describe()  # the workers' compute totals before the generation
            session = route.session()
            got, dec_s = _timed(session.generate(tokens, max_tokens=max_tokens, logits=True))
            rows = list(session.logits)
            costs = route_costs(route, session, before, route.describe(),
                                max(len(got) - 1, 0), dec_s)
            rss = [_rss_bytes(w.proc.pid) for w in cluster.workers[:n_stages]]
            session.close()
            prefix = _prefix_cache(route, tokens, n_ctx=route.n_ctx,
                                   max_tokens=max_tokens, say=say, rollback_window=window)
        if failover:
            fo = _failover(cluster, primaries, mid, whole, codec, relay, tokens, max_tokens,
                           ref, ref_rows, say)
    finally:
        cluster.stop()
    same, n, bits, diff, top1 = _compare(got, rows, ref, ref_rows)
    if codec == "raw":
        criterion, passed = "same tokens and bit-identical logits rows", same and bits
    else:
        criterion, passed = "same tokens (top-1 agreement 1.0)", same and top1 == 1.0
    par = Parity(prompt_tokens=len(tokens), generated_tokens=len(got), tokens_match=same,
                 logits_rows=n, logits_bit_identical=bits, max_abs_diff=diff,
                 top1_agreement=top1, criterion=criterion, passed=passed)
    scenario = Scenario(
        workers="processes on loopback", stages=n_stages, path=costs.path,
        decode_tokens=costs.decode_tokens, decode_ms_per_token=costs.ms_per_token,
        links=costs.links, transport_ms_per_token=costs.transport_ms, seam_ms=costs.seam_ms,
        costs=[StageCost(layers=list(sc.layers), endpoint=sc.endpoint, rss_bytes=r,
                         decode_steps=sc.decode_steps, compute_ms=sc.compute_ms,
                         rtt_ms=sc.rtt_ms, hop_ms=sc.hop_ms)
               for sc, r in zip(costs.stages, rss)],
        notes=list(costs.notes), failover=fo)
    bi = capability.build_info()
    cpu_model, flags, isa = capability.cpu_features()
    dev = capability.device_of(whole)
    lane = Lane(backend=dev["backend"], model_identity=model_identity(model),
                model_name=os.path.basename(model), quantisation=capability.quantisation(model),
                codec=codec, settings=engine_settings.canonical(settings),
                stages=[[a, b] for a, b in ranges],
                device=dev["device"], device_type=dev["device_type"], driver=dev["driver"],
                software_device=dev["software"])
    rec = Certification(
        lane_id=lane_id(lane), lane=lane, llama_cpp_commit=bi["llama_cpp_commit"],
        patch_stack_hash=bi["patch_stack_hash"], wire_schema_version=wire.SCHEMA_VERSION,
        cpu_model=cpu_model, cpu_isa=list(isa), cpu_flags=list(flags), parity=par,
        certified_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        dgr_version=__version__, seconds=round(time.monotonic() - t0, 3), arch=whole.arch,
        scenario=scenario, batching=batching, speculation=speculation, prefix_cache=prefix,
        rollback_window=window, cpu_variant=bi["cpu_variant"])
    ok = passed and (fo is None or fo.passed)
    return rec, (write(rec, store) if ok else None)


def _far(engine, rows: int) -> int:
    """How far into ``engine``'s context the batching and speculation checks measure a second
    time (``dgr.control.prefix.far_start``; 0 for none): kernels may switch with the KV's
    length."""
    from dgr.control.prefix import far_start

    return far_start(int(engine.n_ctx), int(engine.settings["n_ubatch"]), rows)


def _batching(model: str, whole, settings: dict, say, sessions: int = 4) -> Batching:
    """The lane's batched-against-alone record, measured on the whole model with the lane's
    settings (``sessions`` slots at least)."""
    from dgr.control.batching import measure
    from dgr.core.engine import Engine

    eng = whole if whole.n_slots >= sessions else Engine(
        model, **{**settings, "n_slots": sessions})
    steps = 8
    longest = max(2, min(40, int(eng.n_ctx) - steps))
    m = measure(eng, sessions=sessions, decode_steps=steps, longest_prompt=longest,
                far=_far(eng, longest + steps))
    say(f"batched against alone ({m.sessions} sessions, {m.rows} rows): "
        + ("bit-identical" if m.bit_identical else
           f"differ: max |diff| {m.max_abs_diff:.3g}, top-1 agreement {m.top1_agreement:.3f}"))
    return Batching(sessions=m.sessions, decode_steps=m.decode_steps, rows=m.rows,
                    bit_identical=m.bit_identical, max_abs_diff=m.max_abs_diff,
                    top1_agreement=m.top1_agreement)


def _speculation(whole, settings: dict, say, max_draft: int = 4) -> Speculation:
    """The lane's speculative-trips-against-single-steps record, on the whole model."""
    from dgr.control.speculation import measure

    n_ctx = int(whole.n_ctx)
    decode = max(2, min(32, n_ctx - 24 - max_draft))
    prompt = max(1, min(24, n_ctx - decode - max_draft))
    m = measure(whole, prompt_tokens=prompt, decode_tokens=decode, max_draft=max_draft,
                far=_far(whole, prompt + decode + max_draft))  # (it releases its slot)
    say(f"speculative trips against single steps ({m.trips} trips, {m.rows} rows): "
        + ("bit-identical" if m.bit_identical else
           f"differ: max |diff| {m.max_abs_diff:.3g}, top-1 agreement {m.top1_agreement:.3f}"))
    return Speculation(max_draft=m.max_draft, trips=m.trips, rows=m.rows,
                       bit_identical=m.bit_identical, max_abs_diff=m.max_abs_diff,
                       top1_agreement=m.top1_agreement)


def _prefix_cache(route, tokens: list[int], *, n_ctx: int, max_tokens: int,
                  say, rollback_window: int = -1) -> PrefixCache:
    """A chat's two turns through ``route`` (the lane's workers): a first prompt of a whole
    prefill chunk and a half (the parity prompt repeated, where the context allows), a short
    reply, then a next turn (that history plus the parity prompt) on the same session keeping
    what ``reusable`` allows, against the next turn prefilled by a fresh session; every
    sampled token and logits row compared. One session at a time (a lane of one slot)."""
    ub = int(route.settings["n_ubatch"])
    g = max(1, min(8, int(max_tokens)))
    room = n_ctx - 2 * g - len(tokens)  # the first turn's most tokens
    n1 = max(1, min(max(len(tokens), ub + ub // 2), room))
    first = (list(tokens) * (n1 // max(1, len(tokens)) + 1))[:n1]
    kept = route.session()
    try:
        list(kept.generate(first, max_tokens=g))
        nxt = list(kept.history) + list(tokens)[:max(1, n_ctx - g - len(kept.history))]
        keep = kept.reusable(nxt)
        got = list(kept.generate(nxt, max_tokens=g, logits=True, reuse=keep))
        rows = list(kept.logits)
    finally:
        kept.close()
    fresh = route.session()
    try:
        ref = list(fresh.generate(nxt, max_tokens=g, logits=True))
        ref_rows = list(fresh.logits)
    finally:
        fresh.close()
    same, n, bits, diff, _ = _compare(got, rows, ref, ref_rows)
    rec = PrefixCache(prompt_tokens=len(nxt), kept_positions=keep, generated_tokens=len(got),
                      tokens_match=same, logits_rows=n, bit_identical=same and bits,
                      max_abs_diff=diff,
                      partial_rows_exact=[bool(st.prefix_rows_exact) for st in route.stages],
                      decoded_rows_exact=[bool(st.prefix_single_rows_exact)
                                          for st in route.stages],
                      chunk_rows_exact=[bool(st.prefix_chunk_rows_exact)
                                        for st in route.stages])
    say(f"prompt cache: {prefix_cache_line(rec, rollback_window)}")
    return rec


def prefix_cache_line(p: PrefixCache | None, rollback_window: int = -1) -> str:
    """A record's prompt-cache figure in one line (``rollback_window``: the record's)."""
    if p is None:
        return "not measured (a record from before the prompt cache was measured)"
    rule = ("the state snapshots at the ends of whole chunks only: a recurrent state is cut "
            "back to nothing shorter" if rollback_window == 0 else
            "every row, however cut into steps" if p.chunk_rows_exact and all(p.chunk_rows_exact)
            and all(p.decoded_rows_exact)
            else "whole chunks, partial-chunk and decoded rows" if all(p.decoded_rows_exact)
            else "every prompt row, however cut into chunks" if p.chunk_rows_exact
            and all(p.chunk_rows_exact) and all(p.partial_rows_exact)
            else "whole chunks and partial-chunk rows" if all(p.partial_rows_exact)
            else "whole chunks only")
    head = (f"a next turn keeping {p.kept_positions} of its {p.prompt_tokens} prompt "
            f"positions (the stages may keep {rule}) ")
    if p.bit_identical:
        return head + (f"bit-identical to a fresh prefill ({p.logits_rows} rows, "
                       f"{p.generated_tokens} tokens): the prompt cache keeps the whole "
                       "model's tokens")
    return head + (f"NOT bit-identical to a fresh prefill ({p.logits_rows} rows): "
                   f"max |diff| {p.max_abs_diff:.3g}, tokens "
                   + ("match" if p.tokens_match else "differ"))


def speculation_line(s: Speculation | None, rollback_window: int = -1) -> str:
    """A record's speculation figure in one line (``rollback_window``: the record's)."""
    if s is None and rollback_window == 0:
        return ("refused: the lane's recurrent state rolls no rejected draft back (a route "
                "asked to speculate on it is refused by name)")
    if s is None:
        return "not measured (a record from before speculation was measured)"
    if s.bit_identical:
        return (f"speculative trips bit-identical to single steps ({s.rows} rows, up to "
                f"{s.max_draft} drafts): speculation keeps plain decoding's tokens")
    return (f"speculative trips NOT bit-identical to single steps ({s.rows} rows): max |diff| "
            f"{s.max_abs_diff:.3g}, top-1 agreement {s.top1_agreement:.3f}: speculative tokens "
            "agree with plain decoding's up to near ties")


def batching_line(b: Batching | None) -> str:
    """A record's batching figure in one line."""
    if b is None:
        return "not measured (a record from before batching was measured)"
    if b.bit_identical:
        return (f"batched rows bit-identical to alone ({b.sessions} sessions, {b.rows} rows): "
                "batching keeps the whole model's tokens")
    return (f"batched rows NOT bit-identical to alone ({b.sessions} sessions, {b.rows} rows): "
            f"max |diff| {b.max_abs_diff:.3g}, top-1 agreement {b.top1_agreement:.3f}; "
            f"parity mode: {b.parity_mode}")


FAILOVER_CRITERION = ("the whole model's tokens, 1 recovery, the stage served by the spare "
                      "(logits after the re-prefill recorded, not required)")


def _failover(cluster, primaries: list[str], mid: int, whole, codec: str, relay: bool | None,
              tokens: list[int], max_tokens: int, ref: list[int], ref_rows: list,
              say) -> Failover:
    """A second generation on ``primaries`` with the spare (``cluster``'s last worker) in
    the route's pool: the middle primary is SIGKILLed after half the whole model's tokens.

    The route steps one token per driver round trip (no decode loop), so no token is
    computed ahead of the kill: the first step after it meets the dead stage."""
    from dgr.cli.costs import step_path
    from dgr.driver.route import Route

    victim, spare = cluster.workers[mid], cluster.workers[-1]
    k = len(ref) // 2
    with Route(primaries, tokenizer=whole, codec=codec, relay=relay, spares=[spare.endpoint],
               loop=False) as route:
        session = route.session()
        it = iter(session.generate(tokens, max_tokens=max_tokens, logits=True))
        got = [tok for _, tok in zip(range(k), it)]
        say(f"failover: SIGKILL of stage {mid} ({victim.endpoint}) after {len(got)} token(s)")
        victim.kill()
        got += list(it)
        rows = list(session.logits)
        recoveries = session.recoveries
        replaced_by = route.stages[mid].endpoint
        layers = tuple(route.stages[mid].layers)
        replacements = list(route.aroute.replacements)
        path = step_path(route)
        session.close()
    same, n, bits, diff, _ = _compare(got, rows, ref, ref_rows)
    moved = replacements == [(layers, victim.endpoint, spare.endpoint)]
    passed = k >= 1 and same and recoveries == 1 and moved and replaced_by == spare.endpoint
    say(f"failover: {len(got)} tokens, tokens match {same}, {recoveries} recovery(ies), stage "
        f"{mid} now on {replaced_by}; logits bit-identical {bits} (max|diff| {diff:.3g})")
    return Failover(stage=mid, layers=list(layers), killed=victim.endpoint,
                    how=f"SIGKILL after {k} of {len(ref)} tokens", spare=spare.endpoint,
                    replaced_by=replaced_by, path=path, recoveries=recoveries,
                    generated_tokens=len(got), tokens_match=same, logits_rows=n,
                    logits_bit_identical=bits, max_abs_diff=diff,
                    criterion=FAILOVER_CRITERION, passed=passed)


def _timed(tokens) -> tuple[list[int], float]:
    """Drain a token iterator: (tokens, seconds from the first token to the last)."""
    import time

    out: list[int] = []
    t_first = t_last = None
    for tok in tokens:
        t_last = time.perf_counter()
        if t_first is None:
            t_first = t_last
        out.append(int(tok))
    return out, (t_last - t_first) if t_first is not None else 0.0


def _compare(got, rows, ref, ref_rows) -> tuple[bool, int, bool, float, float]:
    """(same tokens, rows compared, rows bit-identical, max |diff|, top-1 agreement)."""
    n = min(len(rows), len(ref_rows))
    bits = n == len(ref_rows) == len(rows) and all(
        a.tobytes() == b.tobytes() for a, b in zip(ref_rows, rows))
    diff = max((float(np.max(np.abs(a.astype(np.float64) - b)))
                for a, b in zip(ref_rows, rows)), default=0.0)
    top1 = (float(np.mean([int(np.argmax(a)) == int(np.argmax(b))
                           for a, b in zip(ref_rows, rows)])) if n else 0.0)
    return list(got) == list(ref), n, bits, diff, top1


def _rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` in bytes (/proc/<pid>/status; 0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


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
    c.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds each worker may take to listen, counted from when the "
                        "previous one listened; all start at once (default 180)")
    c.add_argument("--failover", action="store_true",
                   help="also start a spare for the middle stage and run a second generation "
                        "that SIGKILLs the middle worker after half the tokens: the lane "
                        "passes only if the tokens still match (3 or more stages)")
    c.add_argument("--relay", choices=["auto", "on", "off"], default="auto",
                   help="direct relay over the workers' data plane: auto (default) where it "
                        "applies; off steps hop by hop over gRPC, which records each hop's "
                        "cost (round trip minus compute) in the scenario")
    engine_settings.add_arguments(c)
    c.set_defaults(func=_cmd_certify)
    ls = sub.add_parser("lanes", help="list the certification store's lanes",
                        description="List the certified lanes in the store, and whether each "
                                    "matches this build (llama.cpp commit, patch stack, CPU).")
    ls.add_argument("--store", help="certification store directory")
    ls.add_argument("--json", action="store_true", help="print the records as JSON lines")
    ls.set_defaults(func=_cmd_lanes)


def _cmd_certify(args) -> int:
    from dgr import errors
    from dgr.artifacts import models
    from dgr.core.engine import Engine
    from dgr.protocol.ranges import ranges_for

    from dgr.cli.console import say

    try:
        model = args.model or str(models.path(models.DEFAULT_MODEL))
        settings = engine_settings.from_args(args)
        n_layer = Engine(model, n_ctx=64).n_layer
        ranges = ranges_for(args.splits, args.stages, n_layer)
        rec, path = certify(model, ranges, codec=args.codec, settings=settings,
                            prompt=args.prompt, max_tokens=args.max_tokens, store=args.store,
                            start_timeout=args.start_timeout, failover=args.failover,
                            relay={"auto": None, "on": True, "off": False}[args.relay],
                            progress=say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except errors.DgrError as e:
        return errors.report(e)
    p = rec.parity
    say(f"lane {rec.lane_id}: {p.generated_tokens} tokens, tokens match {p.tokens_match}, "
        f"logits bit-identical {p.logits_bit_identical} over {p.logits_rows} rows, "
        f"max|diff| {p.max_abs_diff:.3g}, top-1 {p.top1_agreement:.3f} ({p.criterion})")
    say(f"scenario: {scenario_line(rec.scenario)}")
    fo = rec.scenario.failover if rec.scenario is not None else None
    if fo is not None and not fo.passed:
        say(f"failover FAILED: {fo.generated_tokens} tokens, tokens match {fo.tokens_match}, "
            f"{fo.recoveries} recovery(ies), stage {fo.stage} on {fo.replaced_by} (spare "
            f"{fo.spare}); needs {fo.criterion}")
    if path is None:
        say("NOT certified: " + ("the failover generation failed" if p.passed
                                 else "the parity suite failed") + "; nothing written")
        return 1
    say(f"certified; record {path}")
    print(path)
    return 0


def _cmd_lanes(args) -> int:
    from dgr._core import arch_supports_layer_range
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
                    and list(rec.cpu_isa) == list(isa)
                    and rec.cpu_variant == bi["cpu_variant"])
        s = lane.settings
        # a split lane holds only where this build splits the architecture (docs/architectures.md)
        split_ok = len(lane.stages) == 1 or (rec.arch and arch_supports_layer_range(rec.arch))
        where = lane.backend if not lane.device else f"{lane.backend}:{lane.device}"
        if lane.software_device:
            where += " [software device, not hardware]"
        print(f"{rec.lane_id}  {where}  {lane.model_name} ({lane.model_identity[:19]})  "
              f"{rec.arch or '?'}  "
              f"{lane.quantisation}  codec={lane.codec}  stages="
              + ",".join(f"[{a},{b})" for a, b in lane.stages)
              + f"  ctx{s.get('n_ctx')} slots{s.get('n_slots')} t{s.get('n_threads')} "
                f"ub{s.get('n_ubatch')} fa{int(bool(s.get('flash_attn')))} "
                f"k{s.get('type_k')} v{s.get('type_v')}  "
                f"{'passed' if rec.parity.passed else 'FAILED'}  {rec.certified_at}  "
                f"{'this build' if build_ok else 'OTHER BUILD'}"
                + ("" if split_ok else f"  NOT SPLITTABLE here ({rec.arch or 'arch unknown'})"))
        print(f"  scenario: {scenario_line(rec.scenario)}")
        print(f"  batching: {batching_line(rec.batching)}")
        print(f"  speculation: {speculation_line(rec.speculation, rec.rollback_window)}")
        print(f"  prompt cache: {prefix_cache_line(rec.prefix_cache, rec.rollback_window)}")
    return 0


def scenario_line(sc: Scenario | None) -> str:
    """A record's scenario in one line: stages, failover, decode ms/token, the largest
    worker RSS, the mean seam (transport per link) cost."""
    if sc is None:
        return "not recorded (a record from before scenarios were kept)"

    def ms(v) -> str:
        return "-" if v is None else f"{v:.3f} ms"

    fo = sc.failover
    if fo is None:
        fail = "failover no"
    else:
        fail = (f"failover yes: stage {fo.stage} [{fo.layers[0]},{fo.layers[1]}) SIGKILLed, "
                f"{fo.recoveries} recover{'y' if fo.recoveries == 1 else 'ies'}, tokens "
                f"{'match' if fo.tokens_match else 'DIFFER'}" + ("" if fo.passed else " FAILED"))
    rss = max((c.rss_bytes for c in sc.costs), default=0)
    return (f"{sc.stages} stages ({sc.workers}, {sc.path}); {fail}; decode "
            f"{ms(sc.decode_ms_per_token)}/token; max RSS {rss / 2**20:.1f} MiB/stage; "
            f"seam {ms(sc.seam_ms)}")
