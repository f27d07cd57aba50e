"""Workers as separate hosts: Linux network namespaces joined by veth pairs on a bridge.

``Netns(n)`` makes a hub namespace holding a bridge, and ``n`` host namespaces, each joined
to the bridge by a veth pair and given its own address ``10.213.<subnet>.<2+i>/24``. Nothing
is configured outside these namespaces (both veth ends are created inside them), and every
namespace is deleted on ``close()``. ``cut(i)`` takes host ``i``'s link down (its packets
vanish: no reset, no error, the peers only see silence), ``restore(i)`` brings it back.

Run something on host ``i`` with ``Netns.exec_args(i) + [...]``, or a worker with
``NetnsWorker``. Needs root and iproute2 (``available()`` says why not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

from dgr.worker.process import WorkerProcess

__all__ = ["Netns", "Host", "NetnsWorker", "available"]


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, why)."""
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed (apt-get install iproute2)"
    if os.geteuid() != 0:
        return False, "network namespaces need root (CI runs as root)"
    name = f"dgr-probe-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return False, f"`ip netns add` failed: {p.stderr.strip()}"
    try:
        for what in (["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                     ["link", "add", "br0", "type", "bridge"]):
            p = subprocess.run(["ip", "-n", name, *what], capture_output=True, text=True)
            if p.returncode != 0:
                return False, f"`ip {' '.join(what)}` failed: {p.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True, ""


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


@dataclass
class Host:
    index: int
    netns: str
    address: str   # without the prefix length


class Netns:
    """``n`` hosts on one bridge, each in a namespace of its own (a context manager)."""

    def __init__(self, n: int, *, subnet: int = 0, tag: str | None = None):
        if not 0 <= subnet <= 255 or not 1 <= n <= 250:
            raise ValueError("subnet must be in [0, 255] and n in [1, 250]")
        self.n = n
        self.subnet = subnet
        self.tag = tag or f"{os.getpid() % 100000}"
        self.hub = f"dgr{self.tag}-hub"
        self.hosts = [Host(i, f"dgr{self.tag}-h{i}", f"10.213.{subnet}.{2 + i}")
                      for i in range(n)]
        self._made: list[str] = []

    def up(self) -> Netns:
        try:
            _ip("netns", "add", self.hub)
            self._made.append(self.hub)
            _ip("-n", self.hub, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(h.netns)
                _ip("-n", h.netns, "link", "set", "lo", "up")
                peer = f"p{h.index}"
                _ip("-n", h.netns, "link", "add", "eth0", "type", "veth", "peer", "name", peer,
                    "netns", self.hub)
                _ip("-n", self.hub, "link", "set", peer, "master", "br0")
                _ip("-n", self.hub, "link", "set", peer, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_args(self, i: int) -> list[str]:
        """Command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.hosts[i].netns]

    def run(self, i: int, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_args(i) + list(args), **kw)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: everything it sends or should receive vanishes."""
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.hosts[i].netns, "link", "set", "eth0", "up")

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made = []

    def __enter__(self) -> Netns:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()


class NetnsWorker(WorkerProcess):
    """A ``python -m dgr.worker`` on host ``i`` of ``net``, listening on its address, and
    relaying to the hosts of ``net`` (``--relay-allow`` its /24: the operator's list of a
    real multi-host route). Without ``--cluster-keys`` or ``--tls-client-auth`` in ``args``
    it runs ``--insecure`` (these namespaces are the test's own)."""

    def __init__(self, net: Netns, i: int, model: str, layers=None, *, port: int = 7000,
                 **kw):
        super().__init__(model, layers, listen=f"{net.hosts[i].address}:{port}", **kw)
        self.net, self.host = net, i
        self.args = [*self.args, "--relay-allow", f"10.213.{net.subnet}.0/24"]
        if "--cluster-keys" not in self.args and "--tls-client-auth" not in self.args:
            self.args.append("--insecure")

    def command(self) -> list[str]:
        return self.net.exec_args(self.host) + super().command()
