"""``python -m dgr``: the command line (the multi-stage demo, and generation over running workers)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from dgr.cli.interrupts import install_interrupts
from dgr.cli.console import say
from dgr.cli.speculate import add_speculate_arguments
from dgr.protocol import settings as engine_settings

__all__ = ["main"]

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."




def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompt raw instead of in the model's chat format")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the best (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide a recent token's logit by this (llama.cpp's; 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from a recent token's logit (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count from a recent token's logit (0 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="the penalties count the last N tokens, the prompt's included "
                        "(default 64, as llama.cpp)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--parity", action="store_true",
                   help="also fetch the logits of every step and compare them bit for bit with "
                        "the whole model (slower: the full vocabulary row travels per token)")
    p.add_argument("--codec", default="raw", choices=["raw", "f16", "bf16", "q8"],
                   help="boundary codec on the wire (raw = exact, the default)")
    p.add_argument("--relay", choices=["auto", "on", "off"], default="auto",
                   help="direct relay over the workers' data plane (each stage forwards to the "
                        "next, the last answers; prefill chunks pipelined): auto (default) uses "
                        "it when every worker serves a data port and the codec is raw; off "
                        "relays every boundary through this process over gRPC")
    add_speculate_arguments(p)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the comparison with the whole model in this process")


def _chat(args, text: str) -> str:
    if args.chat:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return text


def _sampling(args):
    from dgr.protocol.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          penalty_last_n=args.repeat_last_n)


def _stream(route, args, prompt_tokens, detok) -> tuple:
    """Generate on ``route``, echoing text to stdout; returns (session, tokens, t0, t_first, t1)."""
    session = route.session()
    out: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    t_first = t_last = None
    last_shown = 0.0
    for tok in session.generate(prompt_tokens, max_tokens=args.max_tokens,
                                sampling=_sampling(args), stop=args.stop, logits=args.parity):
        now = t_last = time.perf_counter()
        if t_first is None:
            t_first = now
        out.append(tok)
        if now - last_shown < 0.05:  # detokenizing may be an RPC: at most 20 times a second
            continue
        last_shown = now
        text = detok(out)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    t1 = t_last if out else time.perf_counter()
    text = detok(out)
    sys.stdout.write(text[len(shown):] + "\n")
    sys.stdout.flush()
    return session, out, t0, t_first or t1, t1


def _report(route, session, args, prompt, tokens, t0, t_first, t1, whole, before) -> int:
    """Compare with the whole model (when given), print throughput and the cost per seam.

    ``before``: ``route.describe()`` taken before the generation. Each stage's compute per
    decode token is the mean over the single-token steps its worker computed between that
    describe and one taken now (exact totals, not the moving average ``recent_step_ms``),
    so compute and transport add up to the time per token measured over the same steps."""
    from dgr.cli.costs import route_costs
    from dgr.core.local import generate_local

    n_dec = len(tokens) - 1
    dec_s = t1 - t_first
    route_tps = n_dec / dec_s if n_dec > 0 and dec_s > 0 else 0.0
    say(f"{len(tokens)} tokens ({session.stop_reason}); time to first token {t_first - t0:.3f} s; "
         f"decode {route_tps:.1f} tokens/s over {len(route.stages)} stage(s)"
         + (f"; {session.recoveries} recoveries" if session.recoveries else ""))
    trips, drafted, accepted = session.speculation
    if trips and route.aroute.speculate:
        say(f"speculation ({route.aroute.speculate}): {trips} ring trips, "
             f"{(trips + accepted) / trips:.2f} tokens per trip; {accepted} of {drafted} drafts "
             f"accepted ({accepted / drafted if drafted else 0:.0%})")
    rc = 0
    whole_tps = None
    if whole is not None:
        timing: dict = {}
        ref, rows = generate_local(whole, prompt, max_tokens=args.max_tokens,
                                   sampling=_sampling(args), logits=args.parity, timing=timing)
        if args.stop:
            ref = ref[:len(tokens)]
        same = ref == tokens
        line = f"matches the whole model (in-process dgr.Engine, same settings): " \
               f"{'yes' if same else 'NO'}"
        if args.parity:
            n = min(len(rows), len(session.logits))
            bits = n == len(rows) and all(a.tobytes() == b.tobytes()
                                          for a, b in zip(rows, session.logits[:n]))
            line += f"; logits bit-identical over {n} steps: {'yes' if bits else 'NO'}"
            same = same and bits
        say(line)
        if not same:
            rc = 1
        if timing.get("decode_steps"):
            whole_tps = timing["decode_steps"] / timing["decode_s"]
    costs = route_costs(route, session, before, route.describe(), n_dec, dec_s)
    if route.aroute.relay:
        # direct relay: the driver sees whole-route steps; transport = TPOT - compute
        say("stage  layers      endpoint               data port  steps  compute ms")
        for i, sc in enumerate(costs.stages):
            a, b = sc.layers
            fig = (f"{sc.decode_steps:5d}  {sc.compute_ms:10.3f}" if sc.compute_ms is not None
                   else f"{'-':>5}  {'-':>10}")
            say(f"{i:>5}  [{a:>2}, {b:>2})  {sc.endpoint:<21} {sc.data_port:9d}  {fig}")
        say(f"compute ms: mean over the single-token steps each worker computed during the "
             f"generation (steps; {n_dec} decode token(s) timed)")
        for w in costs.notes:
            say(w)
        if costs.transport_ms is not None:
            say(f"direct relay{' with decode loop' if route.aroute.loop else ''}: "
                 f"{costs.ms_per_token:.3f} ms/token = {costs.compute_ms:.3f} ms compute + "
                 f"{costs.transport_ms:.3f} ms transport over {costs.links} links "
                 f"({costs.seam_ms:.3f} ms per link)")
    else:
        say("stage  layers      endpoint               rtt ms  compute ms  hop ms  bytes/step")
        for i, sc in enumerate(costs.stages):
            a, b = sc.layers
            cf = f"{sc.compute_ms:10.3f}" if sc.compute_ms is not None else f"{'-':>10}"
            hf = f"{sc.hop_ms:6.3f}" if sc.hop_ms is not None else f"{'-':>6}"
            say(f"{i:>5}  [{a:>2}, {b:>2})  {sc.endpoint:<21} {sc.rtt_ms:7.3f}  {cf}  "
                 f"{hf}  {sc.bytes_per_step:10.0f}")
        for w in costs.notes:
            say(w)
        if costs.transport_ms is not None:
            msg = f"transport per token: {costs.transport_ms:.3f} ms over {costs.links} hop(s)"
            if costs.links > 1:
                msg += f"; per seam (a seam adds one hop): {costs.seam_ms:.3f} ms"
            say(msg)
    if whole_tps:
        say(f"whole model in this process: decode {whole_tps:.1f} tokens/s; "
             f"route/whole = {route_tps / whole_tps:.2f}")
    return rc


def _cmd_run(args) -> int:
    from dgr import errors
    from dgr.artifacts import models
    from dgr.core.engine import Engine
    from dgr.control.layercost import ranges_of
    from dgr.driver.route import Route, RouteConfig
    from dgr.worker.process import LocalCluster

    install_interrupts()
    cluster = None
    route = None
    try:
        model = args.model or str(models.path(models.DEFAULT_MODEL))
        settings = engine_settings.from_args(args)
        say(f"model {model}")
        whole = Engine(model, **settings)
        n_layer = whole.n_layer
        ranges = ranges_of(args.splits, args.stages, n_layer, model, settings)
        say(f"{len(ranges)} stage(s) over {n_layer} layers: "
             + " ".join(f"[{a},{b})" for a, b in ranges))
        from dgr._core import HAS_LAYER_RANGES

        if len(ranges) > 1 and not HAS_LAYER_RANGES:
            raise errors.UnsupportedArchitecture(
                "this build of dgr's core cannot load partial layer ranges yet (dgr._core."
                "HAS_LAYER_RANGES is False): run with --stages 1, or rebuild with the "
                "layer-range patches (pip install -e .)")
        t0 = time.monotonic()
        cluster = LocalCluster(model, [None if r == (0, n_layer) else r for r in ranges],
                               settings=settings, args=args.worker_arg)

        def progress(i, n, msg):
            say(f"{msg} ({time.monotonic() - t0:.1f} s)")

        say(f"starting {len(ranges)} worker process(es) on loopback ...")
        endpoints = cluster.start(timeout=args.start_timeout, progress=progress)
        route = Route(endpoints, tokenizer=whole, config=RouteConfig.from_args(args))
        prompt = whole.tokenize(_chat(args, args.prompt), True, True)
        say(f"route {','.join(endpoints)}")
        say(f"prompt: {args.prompt!r} ({len(prompt)} tokens)\n")
        return _generate(route, args, prompt, whole.detokenize, whole if args.check else None)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except errors.DgrError as e:
        return errors.report(e)
    finally:
        if route is not None:
            route.close()
        if cluster is not None:
            codes = cluster.stop()
            say(f"workers stopped (exit status {', '.join(map(str, codes))}); logs: "
                 + " ".join(w.log_path for w in cluster.workers))


def _generate(route, args, prompt, detokenize, whole) -> int:
    """Stream one generation over ``route`` and report it (checked against ``whole``, the
    whole model here, unless None); the exit status."""
    before = route.describe()  # the workers' compute totals before the generation
    session, tokens, ts, tf, te = _stream(route, args, prompt, detokenize)
    rc = _report(route, session, args, list(prompt), tokens, ts, tf, te, whole, before)
    session.close()
    return rc


def _cmd_generate(args) -> int:
    from dgr import errors
    from dgr.driver.route import Route, RouteConfig

    install_interrupts()
    route = None
    try:
        route = Route(args.route, config=RouteConfig.from_args(args))
        say("route: " + " -> ".join(f"{s.endpoint} [{s.layers[0]},{s.layers[1]})"
                                     for s in route.stages))
        whole = None
        if args.check:
            whole = _local_reference(args, route)
        prompt = route.tokenize(_chat(args, args.prompt), True, True)
        say(f"prompt: {args.prompt!r} ({len(prompt)} tokens)\n")
        return _generate(route, args, prompt, route.detokenize, whole)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except errors.DgrError as e:
        return errors.report(e)
    finally:
        if route is not None:
            route.close()


def _local_reference(args, route):
    """A whole-model engine with the route's settings, when the model is here (else None)."""
    from dgr.artifacts import models
    from dgr.artifacts.identity import model_identity
    from dgr.core.engine import Engine

    path = args.model
    if path is None:
        try:
            path = str(models.path(models.DEFAULT_MODEL, fetch_missing=False))
        except Exception:  # noqa: BLE001 - no local copy: nothing to compare with
            path = None
    if path is None or not os.path.exists(path):
        say("no local copy of the model (--model PATH): not comparing with the whole model")
        return None
    if model_identity(path) != route.stages[0].model_identity:
        say(f"{path} is not the route's model: not comparing with the whole model")
        return None
    ref = Engine(path, **route.settings, device=args.device)
    kinds = sorted({s.compute for s in route.stages})
    if kinds != [ref.compute]:
        say(f"the whole model here computes on {ref.compute}, the route on "
             f"{', '.join(kinds)}: other kernels, so the bits may differ (--device)")
    return ref


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _cmd_devices(args) -> int:
    import json

    from dgr import errors

    try:
        from dgr.core import backends, devices
        devs, regs = devices(), backends()
    except errors.DgrError as e:
        return errors.report(e)
    if args.json:
        print(json.dumps({"backends": regs, "devices": devs}, indent=2))
        return 0
    print(f"backends in this build: {', '.join(regs)}")
    rows = [("DEVICE", "TYPE", "BACKEND", "FREE / TOTAL", "DESCRIPTION")]
    for d in devs:
        what = d["description"] + (" [software device]" if d["software"] else "")
        if d["driver"]:
            what += f"; driver {d['driver']}"
        rows.append((d["name"], d["type"], d["backend"],
                     f"{_gib(d['memory_free'])} / {_gib(d['memory_total'])}", what))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    for d in devs:
        if "cpu_variant" in d:  # the CPU's code: which kernels a CPU stage runs (and its bits)
            print(f"CPU code: {d['cpu_variant']} (compiled for "
                  f"{' '.join(d['cpu_compiled']) or 'nothing ggml names'})")
    if "Vulkan" in regs and not any(d["backend"] == "Vulkan" for d in devs):
        print("no Vulkan device: ggml lists a software Vulkan device (lavapipe) only when "
              "GGML_VK_VISIBLE_DEVICES names it, e.g. GGML_VK_VISIBLE_DEVICES=0")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """``python -m dgr``'s parser, every subcommand's."""
    ap = argparse.ArgumentParser(
        prog="python -m dgr",
        description="dgr: a distributed GGUF runtime. One model is split into contiguous layer "
                    "ranges, each served by a worker; a route runs a generation across them.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run", help="demo: start N local workers, generate across them, check against the whole "
                    "model",
        description="Start N shard workers on loopback (the model split evenly, or at --splits), "
                    "stream a generation across them, then print whether it matches the whole "
                    "model in this process, tokens/s, and the cost per seam. Fetches the default "
                    "model on first use. The workers are stopped on exit and on Ctrl-C.")
    r.add_argument("--model", help="GGUF path (default: the registry's default model, SmolLM2-135M)")
    r.add_argument("--stages", type=int, default=3, help="number of workers (default 3)")
    r.add_argument("--splits", help="interior split layers, e.g. 10,20 (overrides --stages), "
                                    "or cost: --stages ranges balanced by each layer's time "
                                    "measured on this machine (python -m dgr layer-costs)")
    r.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds to wait for the workers to listen")
    r.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker, e.g. --worker-arg=--inline-below-ms=50 "
                        "(repeatable; see python -m dgr.worker --help)")
    _add_generation_args(r)
    engine_settings.add_arguments(r)
    r.set_defaults(func=_cmd_run)
    g = sub.add_parser(
        "generate", help="generate across workers that are already running",
        description="Generate across running workers (python -m dgr.worker ...) and, when the "
                    "model is available here, check the output against the whole model.")
    g.add_argument("--route", required=True, help="comma-separated host:port of every stage")
    g.add_argument("--model", help="local GGUF of the same model, for the check")
    g.add_argument("--timeout", type=float, default=10.0, help="control call deadline (s)")
    g.add_argument("--mixed-devices", action="store_true",
                   help="allow stages on different kinds of device (CPU and a GPU, two GPU "
                        "models): such a route computes other bits than either whole model")
    g.add_argument("--device", default="cpu",
                   help="where the whole model of the check computes: cpu (default) or a device "
                        "such as Vulkan0 (the route's kind of device gives the same bits)")
    _add_generation_args(g)
    g.set_defaults(func=_cmd_generate)
    d = sub.add_parser(
        "devices", help="list the compute devices this build can use (--device takes the name)",
        description="The compute devices of this build's ggml backends (the CPU first): the "
                    "name --device takes, type, backend, free and total memory, description "
                    "and driver. A software device (lavapipe) is marked: lanes certified on it "
                    "are never hardware lanes.")
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.set_defaults(func=_cmd_devices)
    from dgr.artifacts import cli as artifacts

    artifacts.add_subparser(sub)
    from dgr.cli.certify import add_certify_parser

    add_certify_parser(sub)  # certify, lanes
    from dgr.cli.serve import add_serve_parser

    add_serve_parser(sub)
    for name, _, what in _TOOLS:  # listed in --help; run below with their own parsers
        sub.add_parser(name, help=what, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    tools = {name: module for name, module, _ in _TOOLS}
    if argv and argv[0] in tools:
        # argparse.REMAINDER does not take a subcommand's leading --options: hand them over
        import importlib

        return importlib.import_module(tools[argv[0]]).main(argv[1:])
    args = ap.parse_args(argv)
    return args.func(args)


#: Commands whose parser lives with their module: ``python -m dgr NAME ARGS`` runs its main.
_TOOLS = (("parity", "dgr.control.parity", "compare a split model with the whole model, per step"),
          ("models", "dgr.artifacts.models", "the model registry: fetch, list, path"),
          ("layer-costs", "dgr.control.layercost",
           "time each layer on this machine, and the stage ranges that balance them"))

