"""Whom a worker trusts: the endpoints it may open relay and loop connections to.

A relayed frame names the next stage (``Forward.relay[0]``) and, on the last stage, the decode
loop's first (``Forward.loop[0]``), and the worker connects there. Left open, anyone who can
reach a data port could make the worker connect to any ``host:port`` and send it bytes. So a
worker connects only to endpoints its ``RelayPolicy`` allows, and refuses any other frame with
``RelayRefused`` before it computes anything or opens a connection.

The default allows loopback endpoints only (127.0.0.0/8, ::1, ``localhost``): a route on one
machine works without configuration, and a route across machines needs the operator's
``--relay-allow`` list (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from dgr import errors

__all__ = ["RelayPolicy", "LOOPBACK"]

#: what the default policy allows
LOOPBACK = ("127.0.0.0/8", "::1", "localhost")


def _split(endpoint: str) -> tuple[str, str]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        return endpoint.strip("[]"), ""
    return host.strip("[]"), port


class RelayPolicy:
    """The endpoints a worker may relay or loop to.

    Parameters
    ----------
    allow : iterable of str, optional
        Entries, each one of: ``*`` (any endpoint); an IP address or network in CIDR form
        (``10.0.0.5``, ``10.0.0.0/24``, ``fd00::/8``) or a host name, optionally with
        ``:port`` (``[v6]:port`` for an IPv6 address with a port); without a port any port of
        that host matches. Host names match literally (no DNS lookup: what the frame names is
        what is compared). None: ``LOOPBACK``.

    Raises
    ------
    dgr.errors.InvalidArgument
        An entry that is none of those.
    """

    def __init__(self, allow: Iterable[str] | None = None):
        entries = list(LOOPBACK if allow is None else allow)
        self.entries = entries
        self.any = False
        self._nets: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]] = []
        self._names: list[tuple[str, str]] = []
        for e in entries:
            e = e.strip()
            if not e:
                continue
            if e == "*":
                self.any = True
                continue
            host, port = (e, "") if e.count(":") > 1 and not e.startswith("[") else _split(e)
            if port and not port.isdigit():
                raise errors.InvalidArgument(f"relay allowlist entry {e!r}: port {port!r} "
                                             "is not a number")
            try:
                self._nets.append((ipaddress.ip_network(host, strict=False), port))
            except ValueError:
                if not host or "/" in host:
                    raise errors.InvalidArgument(
                        f"relay allowlist entry {e!r} is neither an address, a network nor "
                        "a host name") from None
                self._names.append((host.lower(), port))
        self._cache: dict[str, bool] = {}

    def allows(self, endpoint: str) -> bool:
        """Whether ``endpoint`` (``host:port``) may be connected to."""
        if self.any:
            return True
        ok = self._cache.get(endpoint)
        if ok is None:
            ok = self._cache[endpoint] = self._match(endpoint)
            if len(self._cache) > 4096:  # endpoints come from frames: bound what is kept
                self._cache.clear()
        return ok

    def _match(self, endpoint: str) -> bool:
        host, port = _split(endpoint)
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            name = host.lower()
            return any(n == name and (not p or p == port) for n, p in self._names)
        return any(addr.version == net.version and addr in net and (not p or p == port)
                   for net, p in self._nets)

    def check(self, endpoint: str, what: str) -> None:
        """Raise ``RelayRefused`` unless ``endpoint`` is allowed (``what``: the field that
        named it, for the message)."""
        if not self.allows(endpoint):
            raise errors.RelayRefused(
                f"{what} names {endpoint!r}, which this worker may not connect to: it relays "
                "only to endpoints on its relay allowlist (--relay-allow)")

    def __repr__(self) -> str:
        return f"RelayPolicy({self.entries!r})"
