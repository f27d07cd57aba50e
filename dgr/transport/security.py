"""Cluster credentials and TLS of the gRPC and data planes (docs/security.md).

A **credential** is a name and a shared secret. A worker started with a credentials file
(``python -m dgr.worker --cluster-keys FILE``) accepts only callers that prove they hold one
of its credentials; a driver or a peer worker presents one. The secret itself never travels:
each gRPC call carries, in the ``x-dgr-auth`` metadata, and each data-plane connection sends
as its first frame, a **token**::

    dgr1.<name>.<unix ms>.<nonce>.<HMAC-SHA256(secret, "dgr1|<purpose>|<name>|<ms>|<nonce>")>

where ``purpose`` is ``grpc:<method>`` or ``data``. The worker checks the MAC in constant
time, that the time is within ``skew`` seconds of its clock, and that the nonce was not seen
in that window: a token captured on the wire cannot be replayed, to this worker or for
another method. A wrong, missing, stale or replayed token gets ``Unauthenticated``, one
message for every case, and nothing of the request is read beyond it.

A credential is either a **driver**'s (a tenant's: it may hold at most ``max_sessions``
sessions and ``max_queued`` admitted steps on a worker, and touch only sessions it opened),
or a **peer**'s (``peer``: the workers of one cluster, which relay each other's frames for
every tenant, so they are not capped and act on any session). The credentials file holds one
credential a line (a secret holds no whitespace and no ``#``, which starts a comment; keep
the file readable by its owner only)::

    # name     secret (>= 16 characters)    options
    workers    8c6f0d3f5b0e41c7a9e2d4b6     peer
    acme       0a1b2c3d4e5f60718293a4b5     sessions=8 queued=32

``TLSConfig`` holds the certificate files of TLS on both planes (mutual TLS with
``client_auth``). ``Security`` is what one process presents (a credential, a CA to verify
workers, a client certificate) and, on a worker, accepts (a ``KeyRing``). Drivers and tools
take theirs from the environment by default (``Security.from_env``): ``DGR_CLUSTER_KEY_FILE``
(the first line is presented, or the one ``DGR_CLUSTER_KEY_NAME`` names), ``DGR_TLS_CA``,
``DGR_TLS_CERT`` and ``DGR_TLS_KEY``.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import threading
import time
from dataclasses import dataclass, field

from dgr import errors

__all__ = ["Credential", "KeyRing", "TLSConfig", "Security", "load_credentials",
           "parse_credentials", "sign", "default_security", "is_loopback", "pick", "CALLER",
           "AUTH_MAGIC", "METADATA_KEY", "PUBLIC_METHODS", "DENIED", "MAX_TOKEN"]

#: the token scheme's version, its first field
VERSION = "dgr1"
#: gRPC metadata key of the token
METADATA_KEY = "x-dgr-auth"
#: the first bytes of a data-plane authentication frame (the token follows, UTF-8)
AUTH_MAGIC = b"DGRAUTH1"
#: methods served without a credential: the standard health service (whether a worker
#: serves, nothing more)
PUBLIC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
#: the one message of every refused token: it does not say what was wrong
DENIED = ("this worker needs a cluster credential it accepts (missing, unknown, wrong, "
          "expired or replayed): docs/security.md")
#: the credential of the caller whose request is being served (set by the gRPC server's
#: interceptor for the handler; None without credentials)
CALLER: contextvars.ContextVar[Credential | None] = contextvars.ContextVar("dgr_caller",
                                                                           default=None)

_NAME = re.compile(r"[A-Za-z0-9_@-]{1,64}$")
_MIN_SECRET = 16
#: longest token accepted (characters)
MAX_TOKEN = 512


@dataclass(frozen=True)
class Credential:
    """A named shared secret and what its holder may do on a worker (module docstring)."""

    name: str
    secret: bytes = field(repr=False)
    peer: bool = False
    max_sessions: int | None = None
    max_queued: int | None = None


def parse_credentials(text: str, source: str = "credentials") -> list[Credential]:
    """The credentials of a credentials file's text (module docstring).

    Raises
    ------
    dgr.errors.InvalidArgument
        A malformed line (named by its number, never by its secret), a repeated name, or
        no credential at all.
    """
    out: list[Credential] = []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        where = f"{source} line {n}"
        if len(parts) < 2:
            raise errors.InvalidArgument(f"{where}: expected 'name secret [options]'")
        name, secret, opts = parts[0], parts[1], parts[2:]
        if not _NAME.match(name):
            raise errors.InvalidArgument(f"{where}: a name is 1-64 of A-Z a-z 0-9 _ @ -")
        if len(secret) < _MIN_SECRET:
            raise errors.InvalidArgument(f"{where}: the secret is shorter than {_MIN_SECRET} "
                                         "characters")
        kw: dict = {}
        for o in opts:
            key, eq, value = o.partition("=")
            if o == "peer":
                kw["peer"] = True
            elif eq and key in ("sessions", "queued") and value.isdigit() and int(value) > 0:
                kw["max_sessions" if key == "sessions" else "max_queued"] = int(value)
            else:
                raise errors.InvalidArgument(f"{where}: unknown option {o!r} (known: peer, "
                                             "sessions=N, queued=N)")
        if any(c.name == name for c in out):
            raise errors.InvalidArgument(f"{where}: the name {name!r} is given twice")
        out.append(Credential(name, secret.encode(), **kw))
    if not out:
        raise errors.InvalidArgument(f"{source} holds no credential")
    return out


def load_credentials(path: str) -> list[Credential]:
    """``parse_credentials`` of the file at ``path``.

    Raises
    ------
    dgr.errors.InvalidArgument
        The file cannot be read, or see ``parse_credentials``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read the credentials file {path}: "
                                     f"{e.strerror}") from None
    if mode & 0o077:
        logging.getLogger("dgr.transport").warning(
            "the credentials file %s may be read by other users (mode %o): chmod 600 it",
            path, mode & 0o777)
    return parse_credentials(text, os.path.basename(path))


def _mac(secret: bytes, purpose: str, name: str, ms: str, nonce: str) -> str:
    msg = f"{VERSION}|{purpose}|{name}|{ms}|{nonce}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(credential: Credential, purpose: str, now: float | None = None,
         nonce: str | None = None) -> str:
    """A fresh token of ``credential`` for ``purpose`` (``grpc:<method>`` or ``data``)."""
    ms = str(int((time.time() if now is None else now) * 1000))
    nonce = nonce or secrets.token_hex(12)
    return ".".join((VERSION, credential.name, ms, nonce,
                     _mac(credential.secret, purpose, credential.name, ms, nonce)))


class KeyRing:
    """The credentials a worker accepts, and the nonces it has seen (thread-safe).

    Parameters
    ----------
    credentials : list of Credential
    skew : float
        Seconds a token's time may differ from this clock (both ways); a nonce is kept
        that long after its token's time, so a replay is refused for as long as the token
        would be accepted.
    clock : callable
        Wall clock (``time.time``; tests inject one).
    max_nonces : int
        Nonces kept at most: beyond, tokens are refused until older ones age out (a
        flood of valid tokens cannot grow memory without bound).
    """

    def __init__(self, credentials: list[Credential], *, skew: float = 300.0,
                 clock=time.time, max_nonces: int = 1 << 20):
        if not credentials:
            raise errors.InvalidArgument("a key ring needs at least one credential")
        self.credentials = {c.name: c for c in credentials}
        self.skew = skew
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._dummy = secrets.token_bytes(32)
        self.refused = 0

    def verify(self, token: str | bytes | None, purpose: str) -> Credential:
        """The credential that signed ``token`` for ``purpose``.

        Raises
        ------
        dgr.errors.Unauthenticated
            Missing, malformed, unknown name, wrong MAC, outside the time window, or a nonce
            seen before (one message for all: ``DENIED``).
        """
        cred = self._check(token, purpose)
        if cred is None:
            self.refuse()
        return cred

    def refuse(self) -> None:
        """Count a refusal and raise ``Unauthenticated`` (``DENIED``)."""
        with self._lock:
            self.refused += 1
        raise errors.Unauthenticated(DENIED)

    def _check(self, token, purpose: str) -> Credential | None:
        if isinstance(token, (bytes, bytearray, memoryview)):
            try:
                token = bytes(token).decode("ascii")
            except UnicodeDecodeError:
                return None
        if not token or len(token) > MAX_TOKEN:
            return None
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != VERSION:
            return None
        _, name, ms, nonce, mac = parts
        cred = self.credentials.get(name)
        # the MAC is computed whether or not the name is known: the time taken does not say
        want = _mac(cred.secret if cred is not None else self._dummy, purpose, name, ms, nonce)
        if not hmac.compare_digest(want.encode(), mac.encode()) or cred is None:
            return None
        if not ms.isdigit() or not 8 <= len(nonce) <= 64:
            return None
        now = self._clock()
        t = int(ms) / 1000.0
        if abs(now - t) > self.skew:
            return None
        with self._lock:
            seen = self._seen
            while seen:  # forget nonces whose tokens are past the window
                oldest, until = next(iter(seen.items()))
                if until > now:
                    break
                del seen[oldest]
            if nonce in seen or len(seen) >= self.max_nonces:
                return None
            seen[nonce] = t + self.skew
        return cred


@dataclass(frozen=True)
class TLSConfig:
    """TLS of both planes: this process's certificate and key, the CA that verifies the other
    end, and whether a server requires a client certificate signed by it (mutual TLS).

    ``cert``/``key`` are required to serve; a client uses them as its client certificate
    when given. Without ``ca`` the system's trust store verifies servers.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_auth: bool = False

    def _read(self, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise errors.InvalidArgument(f"cannot read {path}: {e.strerror}") from None

    def check_server(self) -> None:
        """Raise ``InvalidArgument`` unless this can serve (a certificate, its key, and a CA
        when client certificates are required)."""
        if not self.cert or not self.key:
            raise errors.InvalidArgument("TLS needs both --tls-cert and --tls-key")
        if self.client_auth and not self.ca:
            raise errors.InvalidArgument("--tls-client-auth needs --tls-ca (the CA that signs "
                                         "the client certificates)")
        self.server_context()  # the files load and match

    def server_credentials(self):
        """``grpc.ServerCredentials`` of this configuration."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca) if self.client_auth else None,
            require_client_auth=self.client_auth)

    def channel_credentials(self):
        """``grpc.ChannelCredentials`` of this configuration."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key) if self.cert else None,
            certificate_chain=self._read(self.cert) if self.key else None)

    def server_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` that serves the data plane."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_auth:
                ctx.load_verify_locations(self.ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise errors.InvalidArgument(f"TLS certificate files: {e}") from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` that connects to a worker's data plane (verifying its
        certificate and host name)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert and self.key:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as e:
                raise errors.InvalidArgument(f"TLS client certificate files: {e}") from None
        return ctx


class Security:
    """What a process presents to workers and, on a worker, what it accepts.

    Parameters
    ----------
    credential : Credential, optional
        Presented on every gRPC call and data-plane connection this process makes.
    keys : KeyRing, optional
        A worker's accepted credentials (None: it accepts any caller).
    tls : TLSConfig, optional
        TLS on both planes (None: plaintext).
    """

    def __init__(self, credential: Credential | None = None, keys: KeyRing | None = None,
                 tls: TLSConfig | None = None):
        self.credential = credential
        self.keys = keys
        self.tls = tls
        self._client_ctx: ssl.SSLContext | None = None
        self._server_ctx: ssl.SSLContext | None = None

    @classmethod
    def from_env(cls, env=None) -> Security:
        """A driver's security from ``DGR_CLUSTER_KEY_FILE`` (+ ``DGR_CLUSTER_KEY_NAME``),
        ``DGR_TLS_CA``, ``DGR_TLS_CERT``, ``DGR_TLS_KEY``; nothing set: plaintext, no
        credential."""
        env = os.environ if env is None else env
        cred = None
        if env.get("DGR_CLUSTER_KEY_FILE"):
            cred = pick(load_credentials(env["DGR_CLUSTER_KEY_FILE"]),
                        env.get("DGR_CLUSTER_KEY_NAME") or None)
        tls = None
        if env.get("DGR_TLS_CA") or env.get("DGR_TLS_CERT"):
            tls = TLSConfig(cert=env.get("DGR_TLS_CERT") or None,
                            key=env.get("DGR_TLS_KEY") or None, ca=env.get("DGR_TLS_CA") or None)
        return cls(cred, None, tls)

    # -- presenting ------------------------------------------------------------------------

    def metadata(self, method: str) -> tuple[tuple[str, str], ...] | None:
        """The gRPC metadata of one call of ``method`` (a fresh token), or None."""
        if self.credential is None:
            return None
        return ((METADATA_KEY, sign(self.credential, "grpc:" + method)),)

    def auth_frame(self) -> bytes | None:
        """The first frame of a data-plane connection (without its length prefix), or
        None when there is no credential to present."""
        if self.credential is None:
            return None
        return AUTH_MAGIC + sign(self.credential, "data").encode()

    def client_context(self) -> ssl.SSLContext | None:
        """The data plane's client TLS context (None: plaintext); built once."""
        if self.tls is None:
            return None
        if self._client_ctx is None:
            self._client_ctx = self.tls.client_context()
        return self._client_ctx

    def server_context(self) -> ssl.SSLContext | None:
        """The data plane's server TLS context (None: plaintext); built once."""
        if self.tls is None or not self.tls.cert:
            return None
        if self._server_ctx is None:
            self._server_ctx = self.tls.server_context()
        return self._server_ctx

    # -- accepting -------------------------------------------------------------------------

    def verify_auth_frame(self, frame) -> Credential:
        """The credential of a data-plane connection's first frame.

        Raises
        ------
        dgr.errors.Unauthenticated
            Not an authentication frame, or its token is refused.
        """
        if self.keys is None:
            raise errors.Unauthenticated(DENIED)
        if bytes(frame[:len(AUTH_MAGIC)]) != AUTH_MAGIC:
            self.keys.refuse()
        return self.keys.verify(frame[len(AUTH_MAGIC):], "data")

    def __repr__(self) -> str:
        return (f"Security(credential={self.credential.name if self.credential else None!r}, "
                f"keys={len(self.keys.credentials) if self.keys else 0}, tls={self.tls})")


def pick(credentials: list[Credential], name: str | None = None,
         prefer_peer: bool = False) -> Credential:
    """The credential named ``name``; without one, the first peer credential when
    ``prefer_peer`` (a worker's), else the first.

    Raises
    ------
    dgr.errors.InvalidArgument
        No credential has that name.
    """
    if name is not None:
        for c in credentials:
            if c.name == name:
                return c
        raise errors.InvalidArgument(f"no credential named {name!r} in the credentials file")
    if prefer_peer:
        for c in credentials:
            if c.peer:
                return c
    return credentials[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address literal (no DNS lookup: any
    other name counts as beyond loopback)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_default: Security | None = None
_default_lock = threading.Lock()


def default_security() -> Security:
    """``Security.from_env()``, read once per process (the default of every client)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Security.from_env()
        return _default
