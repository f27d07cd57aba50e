"""What cluster credentials and TLS add to a seam: a 3-stage loopback route, four security modes.

    python benches/tls_seams.py [--rounds 5] [--tokens 64] [--json PATH]
                                [--micro-n 400] [--no-decode] [--no-micro]

Modes (docs/security.md), each a route of three ``python -m dgr.worker`` processes on
loopback (SmolLM2-135M, benches/harness/common.SETTINGS: one thread per stage):

- ``plain``: no credential, no TLS;
- ``keys``: ``--cluster-keys`` (a token on every gRPC call and as the first frame of every
  data-plane connection), plaintext;
- ``tls``: credentials + TLS on both planes (server certificates; the driver and the workers
  as clients verify them against a throwaway CA);
- ``mtls``: credentials + mutual TLS (``--tls-client-auth``: the driver and the workers
  present client certificates of the same CA).

The CA and certificates (``trustme``) and the credentials file are written to a temporary
directory per run. All four routes run at once; each round decodes ``--tokens`` tokens over
every (mode, path), in an order rotated from round to round, so a busy machine skews them
alike; medians of the rounds are reported.

**Decode** (``benches/harness/bench_route.route_decode``: tokens/s after the first
token): over the direct-relay data plane (``relay=True``, the default path; the data plane's
TLS is the tunnel of ``dgr.transport.tls``) and over gRPC (``relay=False``; gRPC's own TLS).
"added ms/seam" is ``(ms/token of the mode - ms/token of plain) / links`` of the medians
("paired": the median over rounds of the same difference within each round), the links a token
crosses (a link: one connection crossed one way, benches/seams.py):

- direct relay with the decode loop (the default): **3** (stage 1 -> 2 -> 3 -> back to 1; the
  token's copy to the driver is off the critical path); without the loop it would be 4;
- gRPC: **6** (the driver's round trip to each of the 3 stages: 2 links each).

"hop ms" is benches/seams.py's transport figure (ms/token minus the stages' compute, per
link with relay; per round trip to a stage, i.e. 2 links, on gRPC), and "added hop ms/link"
the mode's hop ms minus plain's, per link: the same cost with the stages' compute, which
moves with the machine's load, taken out.

**Link micro** (no model): the round trip of one frame over one data-plane connection to an
echo server in another process (a ``DataServer`` whose handler sends each frame back, with
the mode's ``Security``), the client connected with ``dataplane.connect`` and the mode's
``Security`` (TLS through the tunnel thread, then the authentication frame), for a 2304-byte
frame (a 1-token boundary of SmolLM2: 576 f32) and a 64 KiB one, with native (C++) and
Python frame I/O on both ends: p50 / p99 in microseconds (``--micro-n`` round trips a
block, one block per combination per round, interleaved like the decode). Per frame
``keys`` is ``plain`` (the token is sent once per connection); "connect ms" is the median
of ``dataplane.connect`` + the authentication frame + the first echo (TLS: the handshake).
The TLS modes add ``sslsock`` rows: TLS on the connection's own blocking ``ssl.SSLSocket``
at both ends, Python framing, no tunnel. They show how much of the cost is the tunnel.
Loopback round trips depend on the machine's state: on an idle VM they are slower,
because the vCPUs wake slowly. Compare rows within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from harness import cli


MODES = ("plain", "keys", "tls", "mtls")
PATHS = ("relay", "grpc")
#: links a token crosses per path (module docstring); relay without the decode loop: 4
LINKS = {"relay": 3, "grpc": 6}
#: links in one "hop ms" (relay: per link; gRPC: per round trip to a stage)
HOP_LINKS = {"relay": 1, "grpc": 2}
SIZES = (2304, 65536)
IOS = ("native", "python")
#: frame I/O of the TLS modes only: TLS on the connection's own socket, no tunnel
SSLSOCK = "sslsock"
N_STAGES = 3
WORKERS_KEY = "workers"
DRIVER_KEY = "bench"


# -- certificates and credentials -----------------------------------------------------------

def write_pki(d: str) -> dict[str, str]:
    """A throwaway CA in ``d``: ``ca``, a server certificate for 127.0.0.1 / localhost
    (``cert``/``key``; the workers use it as their client certificate too) and a driver's
    client certificate (``ccert``/``ckey``); and ``keys``, a credentials file of a peer
    credential (the workers') and a driver's. Returns the paths."""
    import secrets

    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("driver.bench")
    paths = {}
    for name, blob in (("ca", ca.cert_pem), ("cert", server.cert_chain_pems[0]),
                       ("key", server.private_key_pem), ("ccert", client.cert_chain_pems[0]),
                       ("ckey", client.private_key_pem)):
        paths[name] = os.path.join(d, f"{name}.pem")
        blob.write_to_path(paths[name])
    paths["keys"] = os.path.join(d, "cluster.keys")
    with open(paths["keys"], "w", encoding="utf-8") as f:
        f.write(f"{WORKERS_KEY} {secrets.token_hex(16)} peer\n"
                f"{DRIVER_KEY} {secrets.token_hex(16)}\n")
    os.chmod(paths["keys"], 0o600)
    return paths


def worker_args(mode: str, pki: dict[str, str]) -> list[str]:
    """``python -m dgr.worker`` options of ``mode``."""
    if mode == "plain":
        return []
    args = ["--cluster-keys", pki["keys"]]
    if mode in ("tls", "mtls"):
        args += ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"]]
    if mode == "mtls":
        args.append("--tls-client-auth")
    return args


def driver_security(mode: str, pki: dict[str, str]):
    """The ``Security`` a driver (or a link micro client) presents in ``mode``."""
    from dgr.transport.security import Security, TLSConfig, load_credentials, pick

    if mode == "plain":
        return Security()
    cred = pick(load_credentials(pki["keys"]), DRIVER_KEY)
    tls = None
    if mode == "tls":
        tls = TLSConfig(ca=pki["ca"])
    elif mode == "mtls":
        tls = TLSConfig(cert=pki["ccert"], key=pki["ckey"], ca=pki["ca"])
    return Security(cred, None, tls)


def server_security(mode: str, pki: dict[str, str]):
    """The ``Security`` a worker of ``mode`` accepts with (as ``security_of`` builds it)."""
    from dgr.transport.security import KeyRing, Security, TLSConfig, load_credentials, pick

    if mode == "plain":
        return Security()
    creds = load_credentials(pki["keys"])
    tls = None
    if mode in ("tls", "mtls"):
        tls = TLSConfig(cert=pki["cert"], key=pki["key"], ca=pki["ca"],
                        client_auth=mode == "mtls")
    return Security(pick(creds, prefer_peer=True), KeyRing(creds), tls)


# -- link micro -----------------------------------------------------------------------------

def _conn_class(io: str):
    from dgr.transport.dataplane import FrameSocket

    if io == "python":
        return FrameSocket
    from dgr.worker.frames import HAVE_NATIVE, NativeFrameSocket

    if not HAVE_NATIVE:
        raise RuntimeError("this build has no native frame I/O")
    return NativeFrameSocket


def _echo(conn) -> None:
    while (frame := conn.recv()) is not None:
        conn.send(frame)


class _SSLSockConn:
    """Length-prefixed frames over a blocking ``ssl.SSLSocket`` (the ``sslsock`` rows: TLS
    without the tunnel thread, Python framing; the ``FrameSocket`` calls the micro uses)."""

    def __init__(self, sock):
        self.sock = sock

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                return None
            got += k
        return bytes(buf)

    def send(self, frame) -> None:
        from dgr.transport.dataplane import LEN

        self.sock.sendall(LEN.pack(len(frame)) + bytes(frame))

    def recv(self) -> bytes | None:
        from dgr.transport.dataplane import LEN

        head = self._exact(LEN.size)
        return None if head is None else self._exact(LEN.unpack(head)[0])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _SSLSockEcho:
    """An echo server of ``_SSLSockConn`` frames: a thread per connection, TLS on the
    connection's own blocking socket (no tunnel)."""

    def __init__(self, ctx):
        import socket
        import threading

        self.ctx = ctx
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw) -> None:
        import ssl

        conn = None
        try:
            conn = _SSLSockConn(self.ctx.wrap_socket(raw, server_side=True))
            _echo(conn)
        except (OSError, ssl.SSLError):
            pass
        finally:
            if conn is not None:
                conn.close()
            raw.close()

    def stop(self) -> None:
        self._sock.close()


def echo_servers(mode: str, pki: dict[str, str], ios=IOS) -> dict:
    """One started echo server per frame I/O (a ``DataServer``; ``sslsock``: TLS on a
    blocking socket, no tunnel), with ``mode``'s security."""
    from dgr.transport.dataplane import DataServer

    sec = server_security(mode, pki)
    return {io: (_SSLSockEcho(sec.server_context()) if io == SSLSOCK else
                 DataServer(_echo, conn_class=_conn_class(io), security=sec).start())
            for io in ios}


def _serve_echo(mode: str, pki_dir: str, ios: list[str]) -> int:
    """The echo server process: prints ``ECHO io endpoint`` lines, serves until stdin ends."""
    servers = echo_servers(mode, _pki_paths(pki_dir), ios)
    for io, s in servers.items():
        print(f"ECHO {io} {s.address}", flush=True)
    sys.stdin.read()
    for s in servers.values():
        s.stop()
    return 0


def _pki_paths(d: str) -> dict[str, str]:
    names = ("ca", "cert", "key", "ccert", "ckey")
    return {**{n: os.path.join(d, f"{n}.pem") for n in names},
            "keys": os.path.join(d, "cluster.keys")}


class EchoProcess:
    """``echo_servers`` of one mode in a process of its own (its own TLS tunnel thread, as
    the two ends of a real seam are)."""

    def __init__(self, mode: str, pki_dir: str, ios=IOS, timeout: float = 60.0):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--_echo", mode, pki_dir, *ios],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.endpoints: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while len(self.endpoints) < len(ios):
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"echo server ({mode}) did not start in {timeout} s")
            line = self.proc.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"echo server ({mode}) exited: {self.proc.wait(5)}")
            if line.startswith("ECHO "):
                _, io, ep = line.split()
                self.endpoints[io] = ep

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class EchoClient:
    """One data-plane connection to an echo server, opened as a stage opens a relay link
    (``dataplane.connect``, then the authentication frame)."""

    def __init__(self, endpoint: str, security, io: str, timeout: float = 10.0):
        from dgr.transport import dataplane

        t0 = time.perf_counter()
        if io == SSLSOCK:  # no tunnel, no authentication frame (the echo checks none)
            import socket

            host, port = dataplane.split_endpoint(endpoint)
            raw = socket.create_connection((host, port), timeout=timeout)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                tls = security.client_context().wrap_socket(raw, server_hostname=host)
            except BaseException:
                raw.close()
                raise
            tls.settimeout(None)  # blocking, as the data plane's sockets
            self.conn = _SSLSockConn(tls)
        else:  # blocking, as a stage's relay link (the echo server's end closes on exit)
            self.conn = _conn_class(io)(dataplane.connect(endpoint, timeout, security),
                                        endpoint)
        try:
            auth = security.auth_frame() if io != SSLSOCK else None
            if auth is not None:
                self.conn.send(auth)
            self.rtt(b"x")
        except BaseException:
            self.conn.close()
            raise
        #: seconds from connect to the first echo back
        self.connect_s = time.perf_counter() - t0

    def rtt(self, frame: bytes) -> float:
        """Seconds of one frame's round trip."""
        t0 = time.perf_counter()
        self.conn.send(frame)
        back = self.conn.recv()
        dt = time.perf_counter() - t0
        if back is None or len(back) != len(frame):
            raise RuntimeError(f"echo returned {None if back is None else len(back)} bytes, "
                               f"sent {len(frame)}")
        return dt

    def close(self) -> None:
        self.conn.close()


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (linear between the closest ranks)."""
    s = sorted(xs)
    if not s:
        raise ValueError("no samples")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def micro_ios(mode: str) -> tuple[str, ...]:
    """The frame I/O the link micro measures in ``mode``."""
    return IOS + ((SSLSOCK,) if mode in ("tls", "mtls") else ())


def run_micro(endpoints: dict[str, dict[str, str]], pki: dict[str, str], rounds: int, n: int,
              sizes=SIZES, n_connect: int = 5, log=None) -> dict:
    """Link round trips: ``endpoints[mode][io]`` echo servers; returns per mode, io and size
    the p50/p99 in µs and per mode and io the median connect ms."""
    secs = {m: driver_security(m, pki) for m in endpoints}
    combos = [(m, io) for m in endpoints for io in endpoints[m]]
    samples = {(m, io, size): [] for m, io in combos for size in sizes}
    connects = {c: [] for c in combos}
    clients = {}
    try:
        for m, io in combos:
            clients[(m, io)] = EchoClient(endpoints[m][io], secs[m], io)
        frames = {size: os.urandom(size) for size in sizes}
        order = [(m, io, size) for m, io in combos for size in sizes]
        for r in range(rounds):
            k = r % len(order)
            for m, io, size in order[k:] + order[:k]:
                c, f = clients[(m, io)], frames[size]
                for _ in range(10):  # warm the path (buffers, caches)
                    c.rtt(f)
                samples[(m, io, size)] += [c.rtt(f) for _ in range(n)]
            for m, io in combos:  # fresh connections: handshake + authentication frame
                for _ in range(n_connect):
                    e = EchoClient(endpoints[m][io], secs[m], io)
                    connects[(m, io)].append(e.connect_s)
                    e.close()
            if log:
                log(f"micro round {r + 1}/{rounds} done")
    finally:
        for c in clients.values():
            c.close()
    return summarize_micro(samples, connects)


def summarize_micro(samples: dict, connects: dict) -> dict:
    """``{mode: {io: {"connect_ms": .., "<size>": {"p50_us", "p99_us", "n"}}}}``."""
    out: dict = {}
    for (m, io), xs in connects.items():
        out.setdefault(m, {}).setdefault(io, {})["connect_ms"] = 1e3 * statistics.median(xs)
    for (m, io, size), xs in samples.items():
        out.setdefault(m, {}).setdefault(io, {})[str(size)] = {
            "p50_us": 1e6 * percentile(xs, 50), "p99_us": 1e6 * percentile(xs, 99),
            "n": len(xs)}
    return out


# -- decode over a route --------------------------------------------------------------------

def summarize_decode(samples: dict, links=LINKS) -> dict:
    """Medians of ``samples[(mode, path)]`` (lists of ``route_decode`` results) and the
    ms per seam each mode adds over ``plain`` on the same path."""
    out: dict = {}
    for (mode, path), ms in samples.items():
        tps = statistics.median(m["tokens_per_s"] for m in ms)
        out.setdefault(mode, {})[path] = {
            "tokens_per_s": tps, "ms_per_token": 1e3 / tps,
            "hop_ms": statistics.median(m["hop_ms"] for m in ms),
            "compute_ms": [statistics.median(c) for c in zip(*(m["compute_ms"] for m in ms))],
            "rounds": len(ms), "links": links[path],
            "round_tokens_per_s": [m["tokens_per_s"] for m in ms],
            "round_hop_ms": [m["hop_ms"] for m in ms]}
    for mode, paths in out.items():
        for path, row in paths.items():
            base = out.get("plain", {}).get(path)
            row["added_ms_per_seam"] = (None if base is None else
                                        (row["ms_per_token"] - base["ms_per_token"])
                                        / row["links"])
            # the same, per round against plain's run of that round, then the median
            row["added_ms_per_seam_paired"] = (None if base is None else statistics.median(
                (1e3 / t - 1e3 / b) / row["links"]
                for t, b in zip(row["round_tokens_per_s"], base["round_tokens_per_s"])))
            row["added_hop_ms_per_link"] = (None if base is None else
                                            (row["hop_ms"] - base["hop_ms"])
                                            / HOP_LINKS[path])
    return out


def run_decode(pki: dict[str, str], modes, rounds: int, tokens: int, log=None) -> dict:
    """Start one 3-stage route per mode, decode ``tokens`` tokens per (mode, path) per round
    (rotated order); returns ``summarize_decode`` of the rounds."""
    from harness.bench_route import route_decode
    from harness.clusters import start_cluster
    from harness.common import SETTINGS, smollm2_path

    import dgr

    path = smollm2_path()
    n_layer = dgr.Engine(path, **{**SETTINGS, "n_ctx": 64}).n_layer
    clusters = {}
    try:
        for mode in modes:
            if log:
                log(f"starting {N_STAGES} stages ({mode}) ...")
            clusters[mode] = start_cluster(path, N_STAGES, n_layer, worker_args(mode, pki))
        secs = {m: driver_security(m, pki) for m in modes}
        order = [(m, p) for m in modes for p in PATHS]
        samples = {k: [] for k in order}
        for r in range(rounds):
            k = r % len(order)
            for mode, p in order[k:] + order[:k]:
                m = route_decode(clusters[mode].endpoints, tokens, relay=p == "relay",
                                 security=secs[mode])
                if m["relay"] != (p == "relay") or (p == "relay" and not m.get("loop")):
                    raise RuntimeError(f"{mode}/{p}: the route ran relay={m['relay']} "
                                       f"loop={m.get('loop')} (a link refused?)")
                samples[(mode, p)].append(m)
            if log:
                log(f"decode round {r + 1}/{rounds} done")
    finally:
        for c in clusters.values():
            c.stop()
    return summarize_decode(samples)


# -- report ---------------------------------------------------------------------------------

def table(res: dict) -> str:
    """The printed report of ``res`` (``main``'s JSON)."""
    lines = []
    a = res["args"]
    dec = res.get("decode")
    if dec:
        lines.append(f"Decode, SmolLM2-135M, {N_STAGES} loopback stages (one thread each), "
                     f"{a['tokens']} tokens, median of {a['rounds']} rounds; links a token "
                     f"crosses: relay {LINKS['relay']}, gRPC {LINKS['grpc']}")
        lines.append(f"{'mode':<6} {'path':<6} {'tokens/s':>9} {'ms/token':>9} {'hop ms':>7} "
                     f"{'added ms/seam':>14} {'paired':>7} {'added hop ms/link':>18}")
        for mode in MODES:
            for p in PATHS:
                row = dec.get(mode, {}).get(p)
                if row is None:
                    continue
                add, pair, hop = (row["added_ms_per_seam"], row["added_ms_per_seam_paired"],
                                  row["added_hop_ms_per_link"])
                lines.append(f"{mode:<6} {p:<6} {row['tokens_per_s']:9.1f} "
                             f"{row['ms_per_token']:9.3f} {row['hop_ms']:7.3f} "
                             f"{'' if add is None else f'{add:+.3f}':>14} "
                             f"{'' if pair is None else f'{pair:+.3f}':>7} "
                             f"{'' if hop is None else f'{hop:+.3f}':>18}")
    mic = res.get("micro")
    if mic:
        if lines:
            lines.append("")
        lines.append(f"Link round trip (echo server in another process), µs, "
                     f"{a['micro_n']} x {a['rounds']} round trips per cell; connect = "
                     "connect + auth frame + first echo")
        head = f"{'mode':<6} {'frame I/O':<9} {'connect ms':>10}"
        for size in SIZES:
            head += f" {f'{size} B p50':>11} {'p99':>7}"
        lines.append(head)
        for mode in MODES:
            for io in (*IOS, SSLSOCK):
                row = mic.get(mode, {}).get(io)
                if row is None:
                    continue
                line = f"{mode:<6} {io:<9} {row['connect_ms']:10.2f}"
                for size in SIZES:
                    c = row.get(str(size))
                    line += (f" {c['p50_us']:11.1f} {c['p99_us']:7.1f}" if c
                             else f" {'':>11} {'':>7}")
                lines.append(line)
    lines.append(f"load average {res['load_average']:.1f} at the end")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = cli.parser(__doc__, rounds=5, json=True)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per route_decode")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(MODES)} (plain is always run)")
    ap.add_argument("--micro-n", type=int, default=400,
                    help="link round trips per block (one block per cell per round)")
    ap.add_argument("--no-decode", action="store_true", help="only the link micro")
    ap.add_argument("--no-micro", action="store_true", help="only the decode")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or args.rounds < 1 or args.tokens < 1 or args.micro_n < 1:
        ap.error(f"unknown mode(s) {bad}" if bad else "--rounds, --tokens, --micro-n >= 1")
    args.modes = [m for m in MODES if m == "plain" or m in modes]
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--_echo":
        return _serve_echo(sys.argv[2], sys.argv[3], sys.argv[4:])
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    res: dict = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="dgr-tls-bench-") as d:
        pki = write_pki(d)
        if not args.no_micro:
            procs = {}
            try:
                for m in args.modes:
                    procs[m] = EchoProcess(m, d, micro_ios(m))
                res["micro"] = run_micro({m: p.endpoints for m, p in procs.items()}, pki,
                                         args.rounds, args.micro_n, log=log)
            finally:
                for p in procs.values():
                    p.close()
        if not args.no_decode:
            res["decode"] = run_decode(pki, args.modes, args.rounds, args.tokens, log=log)
    res["load_average"] = os.getloadavg()[0]
    print(table(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
