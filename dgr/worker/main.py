"""``python -m dgr.worker``: serve one layer range of a GGUF model as a shard worker."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from dgr import errors
from dgr.protocol import settings as engine_settings
from dgr.protocol.settings import settings_tag
from dgr.transport.server import ShardServer
from dgr.worker.config import WorkerConfig
from dgr.worker.worker import Worker

__all__ = ["main", "build_parser"]

log = logging.getLogger("dgr.worker")


def _relay_allow(values: list[str] | None) -> list[str] | None:
    """``--relay-allow`` values (each comma-separated) as one list; None: the default."""
    if not values:
        return None
    return [e.strip() for v in values for e in v.split(",") if e.strip()]


def _parse_layers(text: str | None) -> tuple[int, int] | None:
    if text in (None, "", "all"):
        return None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise SystemExit(f"--layers must look like A:B (e.g. 0:10), got {text!r}") from None


def security_of(args):
    """The worker's ``Security`` from its options (``--cluster-keys``, ``--present-key``,
    ``--tls-*``), and the secure default: listening beyond loopback without a credential
    needs ``--insecure`` (and is logged as a warning).

    Raises
    ------
    dgr.errors.InvalidArgument
        A credentials or certificate file that cannot be used, an option without the one it
        needs, or a non-loopback ``--listen`` without credentials or ``--insecure``.
    """
    from dgr.transport.security import (
        KeyRing,
        Security,
        TLSConfig,
        is_loopback,
        load_credentials,
        pick,
    )

    keys = cred = tls = None
    if args.cluster_keys:
        creds = load_credentials(args.cluster_keys)
        keys = KeyRing(creds, skew=args.auth_skew)
        cred = pick(creds, args.present_key, prefer_peer=True)
        if not cred.peer:
            log.warning("this worker presents %r to the next stages, which is not a peer "
                        "credential: the sessions it relays count against that credential's "
                        "caps there (mark the workers' line 'peer')", cred.name)
    elif args.present_key:
        raise errors.InvalidArgument("--present-key names a credential of --cluster-keys")
    if args.tls_cert or args.tls_key or args.tls_ca or args.tls_client_auth:
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                        client_auth=args.tls_client_auth)
        tls.check_server()
    host = args.listen.rsplit(":", 1)[0]
    if not is_loopback(host) and keys is None and not (tls and tls.client_auth):
        if not args.insecure:
            raise errors.InvalidArgument(
                f"--listen {args.listen} is reachable beyond this machine and no credential "
                "protects it: give --cluster-keys FILE (or --tls-client-auth), or --insecure "
                "to serve anyone who can reach it (docs/security.md)")
        log.warning("INSECURE: listening on %s with no credential: anyone who can reach it "
                    "may run steps, read their tokens and drop sessions", args.listen)
    return Security(cred, keys, tls)


async def _serve(args) -> int:
    from dgr.core.engine import Engine
    from dgr.worker.trust import RelayPolicy

    relay_allow = _relay_allow(args.relay_allow)
    RelayPolicy(relay_allow)  # a bad entry fails here, before the model loads
    config = WorkerConfig.from_args(args)  # every setting checked before the model loads
    security = security_of(args)  # and so does a bad credential or certificate
    model = args.model
    if model is None:
        from dgr.artifacts import models

        model = str(models.path(models.DEFAULT_MODEL))
    t0 = time.monotonic()
    log.info("loading %s layers %s", model, args.layers or "all")
    engine = await asyncio.get_running_loop().run_in_executor(None, lambda: Engine(
        model, layers=_parse_layers(args.layers), mtp=args.mtp,
        state_snapshots=args.state_snapshots, **engine_settings.from_args(args)))
    worker = Worker(engine, config=config, relay_allow=relay_allow, security=security)
    if args.trace:
        worker.trace = open(args.trace, "a", buffering=1 << 16)
    worker.advertise_data_port = args.advertise_data_port
    server = ShardServer(worker, args.listen, maximum_concurrent_rpcs=args.max_streams,
                         security=security)
    await server.start()
    addr = server.address
    if args.data_port >= 0:
        try:
            worker.serve_data(addr.rsplit(":", 1)[0].strip("[]"), args.data_port,
                              args.max_data_connections,
                              args.max_data_connections_per_address or None,
                              args.frame_timeout if args.frame_timeout > 0 else None)
        except BaseException:
            await server.stop(None)
            raise
        log.info("data plane (direct relay) on port %d", worker.data_server.port)
    worker.name = addr
    p = worker.pipeline
    a, b = p.layers
    log.info("serving %s layers [%d, %d) of %d, %s, %d slots of %d context tokens, loaded in "
             "%.1f s", engine.arch, a, b, p.n_layer, settings_tag(p.settings), engine.n_slots,
             p.n_ctx, time.monotonic() - t0)
    if p.info.get("n_ctx_source", "set") != "set":
        log.info("context: %d tokens per session, chosen by %s", p.n_ctx, p.info["n_ctx_source"])
    metrics = None
    if args.metrics_port is not None:
        from dgr.control.metrics import MetricsServer

        metrics = MetricsServer(worker, args.metrics_host, args.metrics_port).start()
        log.info("Prometheus metrics on http://%s/metrics", metrics.address)
    print(f"LISTENING {addr}", flush=True)

    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def on_signal(signame: str) -> None:
        log.info("%s received", signame)
        loop.create_task(_drain_then(done, worker, server, args.drain_timeout))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    tasks = [loop.create_task(worker.housekeeping(min(args.ttl / 4, 5.0)))]
    if args.parent_pid:
        tasks.append(loop.create_task(_watch_parent(args.parent_pid, on_signal)))
    await done.wait()
    for t in tasks:
        t.cancel()
    if metrics is not None:
        metrics.stop()
    # drained: a repeated SIGTERM/SIGINT during interpreter shutdown must not turn exit 0
    # into death by signal once the loop's handlers are gone
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return 0


async def _drain_then(done: asyncio.Event, worker: Worker, server: ShardServer,
                      timeout: float) -> None:
    try:
        await worker.drain(server, timeout)
    finally:
        done.set()


async def _watch_parent(pid: int, on_signal) -> None:
    while os.getppid() == pid:
        await asyncio.sleep(0.5)
    on_signal("parent exit")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dgr.worker",
        description="Serve layers [A, B) of a GGUF model as a dgr shard worker (gRPC). Prints "
                    "'LISTENING host:port' on stdout once it serves; logs to stderr; SIGTERM "
                    "drains (health NOT_SERVING, in-flight steps finish, new work refused) and "
                    "exits 0.")
    p.add_argument("--model", help="GGUF path (default: the registry's default model)")
    p.add_argument("--layers", help="owned range A:B (default: the whole model)")
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="host:port to bind (default 127.0.0.1:0: loopback, a free port)")
    p.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the fast data plane (length-prefixed frames, direct relay; "
                        "docs/dataplane.md) on the --listen host (default 0: any free port, "
                        "advertised in Describe; -1: none, steps only over gRPC)")
    p.add_argument("--max-data-connections", type=int, default=256,
                   help="data-plane connections served at once (each holds a thread; more are "
                        "refused with ResourceExhausted; default 256)")
    p.add_argument("--max-data-connections-per-address", type=int, default=64,
                   help="data-plane connections served at once from one remote address (more "
                        "are refused with ResourceExhausted; default 64; 0: no cap but the "
                        "total)")
    p.add_argument("--frame-timeout", type=float, default=30.0,
                   help="seconds a data-plane frame may take from its first byte to its last "
                        "(a peer that sends a length and stalls is answered FrameTruncated and "
                        "cut off; default 30; 0: no deadline). Idle connections are not "
                        "affected: the wait for a frame's first byte is unbounded")
    p.add_argument("--advertise-data-port", type=int, default=0,
                   help="data port to name in Describe instead of the bound one (a proxy, port "
                        "forward or link emulator in front of it; default: the bound port)")
    p.add_argument("--trace", default=None,
                   help="append one JSON line per data-plane step to this file (stage, session, "
                        "positions, arrival/compute/send times from CLOCK_MONOTONIC): a timeline "
                        "of the stages (benches/timeline.py)")
    engine_settings.add_arguments(p)
    p.add_argument("--ttl", type=float, default=600.0,
                   help="seconds after which an idle session expires (default 600)")
    p.add_argument("--prefix-entries", type=int, default=None, metavar="N",
                   help="the prefix store's size: ended sessions whose caches this stage "
                        "keeps when their driver asks (a front does), each on a slot no "
                        "session holds, for later sessions of the same credential and tenant "
                        "that begin with the same tokens; a new session that finds no free "
                        "slot takes the least recently used entry's, and an entry idle --ttl "
                        "seconds is dropped. Default: every slot (none with MTP or on DeepSeek "
                        "V4, whose caches cannot be cut back); 0: off")
    p.add_argument("--evict-after", type=float, default=5.0,
                   help="idle seconds before a session may be evicted for a new one (default 5)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight steps; admitted steps that have "
                        "not started computing by then are not run (default 30)")
    p.add_argument("--max-streams", type=int, default=None,
                   help="refuse RPCs beyond this many concurrent ones (default: no limit)")
    p.add_argument("--inline-compute", action="store_true",
                   help="compute on the event loop thread (one thread handoff less per step; "
                        "control RPCs wait for the running step)")
    p.add_argument("--inline-below-ms", type=float, default=0.0,
                   help="compute single-token steps on the event loop thread while they take "
                        "less than this many ms and the compute thread is idle (default 0: "
                        "never; every step runs off the event loop)")
    p.add_argument("--busy-poll-us", type=int, default=0, metavar="US",
                   help="wait for a data-plane frame by polling its connection for up to US "
                        "microseconds before sleeping (default 0: sleep at once). Keeps the "
                        "core awake and its caches warm between a route's steps, which makes "
                        "a stage's next forward faster; for a stage that owns its cores: "
                        "with more stages than cores, polling takes CPU from their compute "
                        "(docs/performance.md)")
    p.add_argument("--mmproj", default="", metavar="GGUF",
                   help="the model's projector (an mmproj GGUF) beside this stage, which must "
                        "be the first (layers from 0): it encodes images and audio on this "
                        "stage's device for the route (libmtmd; docs/media.md)")
    p.add_argument("--mtp", action="store_true",
                   help="load the model's multi-token-prediction (NextN) block and draft with "
                        "it for routes that speculate with mtp (docs/speculative.md); only on "
                        "the last stage of a model that has one (DeepSeek V4)")
    p.add_argument("--state-snapshots", type=int, default=4, metavar="N",
                   help="a recurrent or hybrid model (Mamba, Qwen3.5, Nemotron-H, ...): keep a "
                        "snapshot of each session's state at the ends of its last N whole "
                        "--ubatch chunks prefilled from position 0, in host memory (the "
                        "describe record's state_bytes each), so that a prompt cache's next "
                        "turn restores one instead of prefilling from 0 (default 4; 0: none). "
                        "Other models ignore it")
    p.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True,
                   help="compute the ready steps of several sessions as one forward (default "
                        "on; steps marked solo, the parity mode's, always run alone): "
                        "docs/batching.md")
    p.add_argument("--relay-allow", action="append", metavar="LIST",
                   help="endpoints relayed frames may make this worker connect to (the next "
                        "stage, the decode loop's first): comma-separated addresses, CIDR "
                        "networks or host names, each with an optional :port, or * for any; "
                        "repeatable. Default: loopback only (127.0.0.0/8, ::1, localhost); a "
                        "route across machines needs its stages' addresses here. Any other "
                        "endpoint gets RelayRefused and no connection: docs/security.md")
    g = p.add_argument_group(
        "security", "credentials, TLS and per-credential caps (docs/security.md). Without "
        "--cluster-keys anyone who can reach the ports is served: the default --listen is "
        "loopback, and any other address needs --cluster-keys (or --tls-client-auth) or "
        "--insecure")
    g.add_argument("--cluster-keys", metavar="FILE",
                   help="credentials file ('name secret [peer] [sessions=N] [queued=N]' a "
                        "line): every gRPC call (but health) and data-plane connection must "
                        "present one of them; this worker presents its first peer entry to "
                        "the next stages")
    g.add_argument("--present-key", metavar="NAME",
                   help="the credential of --cluster-keys this worker presents to other "
                        "workers (default: the first marked peer, else the first)")
    g.add_argument("--auth-skew", type=float, default=300.0,
                   help="seconds a credential token's time may differ from this clock; a "
                        "token is single-use within that window (default 300)")
    g.add_argument("--tls-cert", metavar="PEM", help="certificate (chain) to serve TLS on both "
                   "planes, and to present as a client certificate to the next stages")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--tls-ca", metavar="PEM",
                   help="CA certificates that verify the next stages (and, with "
                        "--tls-client-auth, the clients); default: the system's")
    g.add_argument("--tls-client-auth", action="store_true",
                   help="mutual TLS: clients must present a certificate signed by --tls-ca")
    g.add_argument("--insecure", action="store_true",
                   help="allow --listen beyond loopback with no credential (logged as a "
                        "warning)")
    g.add_argument("--max-sessions-per-credential", type=int, default=0,
                   help="sessions one non-peer credential may hold here when its own "
                        "sessions=N is unset (default 0: no cap but the slots)")
    g.add_argument("--max-queued-per-credential", type=int, default=0,
                   help="steps one non-peer credential may have admitted and unfinished here "
                        "when its own queued=N is unset (default 0: no cap)")
    p.add_argument("--ring-groups", action=argparse.BooleanOptionalAction, default=True,
                   help="cap a batch so that the sessions of a decode loop travel their ring "
                        "in as many groups as it has stages, keeping every stage busy "
                        "(default on; off: a batch takes every ready step): docs/batching.md")
    p.add_argument("--frames", choices=("native", "python"), default="native",
                   help="the data plane's per-frame work (receive, checks, encode, send): "
                        "native (C++, default) or python (dgr.protocol.wire; the reference "
                        "it is fuzzed against, for comparison): docs/dataplane.md")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="drain and exit when this process is no longer our parent")
    p.add_argument("--cert-store", default=os.environ.get("DGR_CERT_STORE"),
                   help="certification store directory: advertise the lanes certified there "
                        "that match this worker exactly (python -m dgr certify; default "
                        "$DGR_CERT_STORE; unset: advertise none)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="[dgr.worker %(process)d] %(message)s")
    try:
        return asyncio.run(_serve(args))
    except errors.DgrError as e:
        return errors.report(e)
