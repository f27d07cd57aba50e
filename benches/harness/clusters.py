"""Clusters a benchmark runs on: local workers, and the same behind link emulators.

``start_cluster`` starts a ``LocalCluster`` of workers with the benchmarks' settings;
``EmulatedCluster`` puts a ``dgr.testing.linkemu`` process on every link of both planes (RTT/2
each way); ``seams_model`` says how many round trips a decode token pays on either path."""

from __future__ import annotations

import math
import shlex
import socket
import subprocess
import sys

from .common import SETTINGS

#: AsyncRoute's loop_window for the relayed decode loop, passed explicitly by the benchmarks
LOOP_WINDOW = 32


def route_ranges(n_layer: int, n: int):
    from dgr.protocol.ranges import split_layers

    return [None] if n == 1 else split_layers(n_layer, n)


def start_cluster(path: str, n_stages: int, n_layer: int = 30, args=(), n_slots: int = 1,
                  worker_args=None):
    """A LocalCluster of ``n_stages`` workers, started (raise NotImplementedError when the
    build cannot serve partial ranges: asv then skips the benchmark).

    ``n_slots``: sessions per worker (1 by default, as the in-process whole model);
    ``worker_args``: optional per-worker extra arguments (a list of ``n_stages`` lists, e.g.
    ``--data-port D --advertise-data-port P``), after ``args``."""
    from dgr._core import HAS_LAYER_RANGES
    from dgr.worker.process import LocalCluster

    if n_stages > 1 and not HAS_LAYER_RANGES:
        raise NotImplementedError("partial layer ranges are not in this build")
    # the engine's default n_slots (1), as the in-process whole model: same settings everywhere
    settings = {**SETTINGS, "n_slots": n_slots}
    c = LocalCluster(path, route_ranges(n_layer, n_stages), settings=settings, args=list(args))
    for w, extra in zip(c.workers, worker_args or ()):
        w.args = [*w.args, *extra]
    c.start(timeout=180)
    return c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_emulators(procs) -> None:
    """Stop link emulator processes (closing stdin ends them)."""
    for p in procs:
        try:
            p.stdin.close()
            p.wait(5)
        except Exception:  # noqa: BLE001
            p.kill()
            p.wait()


class Emulated:
    """A ``dgr.testing.linkemu`` process (delay RTT/2 each way, as benches/wan.py) in front
    of each endpoint; ``endpoints`` are the proxies. ``listens``: the ``host:port`` each
    proxy listens on (default: any free port)."""

    def __init__(self, targets, rtt_ms: float, listens=None):
        self.targets, self.rtt_ms = list(targets), rtt_ms
        self.listens = list(listens) if listens else ["127.0.0.1:0"] * len(self.targets)
        self.procs, self.endpoints = [], []

    def start(self, timeout: float = 30.0) -> list[str]:
        try:
            for ep, ls in zip(self.targets, self.listens):  # as wan._emulators, quieter
                p = subprocess.Popen([sys.executable, "-m", "dgr.testing.linkemu", "--target",
                                      ep, "--listen", ls, "--delay-ms", str(self.rtt_ms / 2)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
                self.procs.append(p)
                line = p.stdout.readline().split()
                if not line or line[0] != "LISTENING":
                    raise RuntimeError(f"link emulator for {ep} did not start")
                self.endpoints.append(line[1])
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def set_rtt(self, rtt_ms: float) -> None:
        """Change every proxy's delay to RTT/2 each way (waits for each one's OK)."""
        for p in self.procs:
            p.stdin.write(f"delay {rtt_ms / 2}\n")
            p.stdin.flush()
        for p in self.procs:
            if not p.stdout.readline().startswith("OK"):
                raise RuntimeError("link emulator did not take the new delay")
        self.rtt_ms = rtt_ms

    def stop(self) -> None:
        stop_emulators(self.procs)
        for p in self.procs:
            p.stdout.close()
        self.procs = []


class _Proxied:
    """A cluster seen through emulators (route_measure needs endpoints and workers)."""

    def __init__(self, cluster, emu: Emulated):
        self.workers, self.endpoints = cluster.workers, emu.endpoints


class EmulatedCluster:
    """``n`` workers behind link emulators on both planes, for relay=False and relay=True.

    Worker i binds its data plane on a chosen port D_i and advertises P_i
    (``--data-port D_i --advertise-data-port P_i``); a linkemu listens on P_i and forwards to
    D_i, another fronts its gRPC port. Every data-plane link (driver -> stage 1, stage k ->
    stage k+1, and the last stage's reply to the driver, which goes back over the driver's
    connection to P_n) then crosses one emulator one way: RTT/2.
    """

    def __init__(self, path: str, n: int, n_layer: int, rtt_ms: float, args=(),
                 n_slots: int = 1):
        self.n, self.path, self.n_layer, self.rtt_ms = n, path, n_layer, rtt_ms
        self.args = list(args)  # extra arguments for every worker
        self.n_slots = n_slots
        self.cluster = self.grpc = self.data = None

    def start(self) -> EmulatedCluster:
        ports = [(free_port(), free_port()) for _ in range(self.n)]
        try:
            self.cluster = start_cluster(
                self.path, self.n, self.n_layer, args=self.args, n_slots=self.n_slots,
                worker_args=[["--data-port", str(d), "--advertise-data-port", str(p)]
                             for d, p in ports])
            self.data = Emulated([f"127.0.0.1:{d}" for d, _ in ports], self.rtt_ms,
                                 listens=[f"127.0.0.1:{p}" for _, p in ports])
            self.data.start()
            self.grpc = Emulated(self.cluster.endpoints, self.rtt_ms)
            self.grpc.start()
        except BaseException:
            self.stop()
            raise
        self.workers, self.endpoints = self.cluster.workers, self.grpc.endpoints
        return self

    def set_rtt(self, rtt_ms: float) -> None:
        self.grpc.set_rtt(rtt_ms)
        self.data.set_rtt(rtt_ms)
        self.rtt_ms = rtt_ms

    def stop(self) -> None:
        for e in (self.grpc, self.data):
            if e is not None:
                e.stop()
        if self.cluster is not None:
            self.cluster.stop()


def worker_lines(cluster) -> list[str]:
    workers = getattr(cluster, "cluster", cluster).workers  # EmulatedCluster wraps one
    return [shlex.join(w.command()) for w in workers]


def seams_model(kind: str, n: int, steps: int, window: int = LOOP_WINDOW) -> float:
    """S in TPOT = C + S * RTT: round trips a decode token pays for ``n`` stages, averaged
    over ``steps`` decode steps timed from the first token (the prompt's).

    relay (benches/compare.py's ``route_kwargs(True)``: the decode loop, ``window`` tokens a
    window): a token crosses n one-way links of RTT/2 (1 -> 2 -> ... -> n -> 1; the driver only
    reads), and every window, the first included, starts from the driver: the token before it
    reaches the driver (n -> driver), which sends it to stage 1 (driver -> 1), one link more
    than n -> 1: n/2 + ceil(steps / window) / (2 * steps).
    dgr (gRPC hop by hop, the driver relays): one driver round trip per stage: n."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if kind != "relay":
        return float(n)
    return n / 2 + math.ceil(steps / window) / (2 * steps)
