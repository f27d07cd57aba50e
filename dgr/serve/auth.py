"""API keys for the HTTP front: OpenAI's ``Authorization: Bearer <key>``, or Anthropic's
``x-api-key: <key>`` (docs/serve.md).

``ApiKeys`` is an ASGI middleware. With keys configured (``python -m dgr serve
--api-key-file FILE`` or ``DGR_API_KEYS``), every request except ``PUBLIC`` needs one of the
keys, or it gets a 401 in OpenAI's error shape, with ``WWW-Authenticate: Bearer``. The public
paths are the health probe and the status page's own files, which hold no data; the page asks
for a key when its ``/status`` request is refused. A key is compared in constant time against
every configured key (``hmac.compare_digest`` of SHA-256 digests), and is never logged or
echoed.

Each key has a name, which is not secret: ``NAME KEY`` on a line of the key file, or
``key-N`` for a bare ``KEY`` (N its place among all keys). A request that presents a key
carries that name in its ASGI scope under ``KEY_SCOPE``, public paths included; the app caps
the requests each name has in flight and logs and counts by name, never by secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ApiKey", "ApiKeys", "KEY_SCOPE", "PUBLIC", "load_keys"]

#: paths served without a key: the health probe, the status page and its static files
PUBLIC = ("/health", "/", "/static/")
#: the ASGI scope entry that names the key a request presented (absent: no valid key)
KEY_SCOPE = "dgr.api_key"
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


@dataclass(frozen=True)
class ApiKey:
    """A configured key: ``name`` (what logs, metrics and ``/status`` show) and ``secret``
    (what a client sends; left out of the repr)."""

    name: str
    secret: str = field(repr=False)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _entry(text: str, place: int) -> ApiKey:
    """One key from ``KEY`` or ``NAME KEY``; errors name the key's place, never the key."""
    parts = text.split()
    if len(parts) == 1:
        name, secret = f"key-{place}", parts[0]
    elif len(parts) == 2:
        name, secret = parts
        if not _NAME.fullmatch(name):
            raise ValueError(f"API key {place}: a name is 1 to 64 letters, digits or _.@-")
    else:
        raise ValueError(f"API key {place}: expected KEY or NAME KEY")
    if len(secret) < 8:
        raise ValueError(f"API key {place} is shorter than 8 characters or holds whitespace")
    return ApiKey(name, secret)


def load_keys(path: str | None = None, env: str | None = None) -> list[ApiKey]:
    """Keys from ``path`` (one a line, ``KEY`` or ``NAME KEY``; blank lines and lines
    starting with ``#`` skipped) and from ``env`` (the value of ``DGR_API_KEYS``:
    comma-separated entries of the same form). A bare ``KEY`` is named ``key-N``, N its place
    among all keys (1-based). A key never holds whitespace, so every file of bare keys reads
    as it always did.

    Raises
    ------
    OSError
        ``path`` cannot be read.
    ValueError
        A key shorter than 8 characters, a bad name, a line of more than two fields, or two
        keys of one name.
    """
    entries: list[str] = []
    if path:
        with open(path, encoding="utf-8") as f:
            entries += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if env:
        entries += [k.strip() for k in env.split(",") if k.strip()]
    keys = [_entry(e, i + 1) for i, e in enumerate(entries)]
    seen: set[str] = set()
    for k in keys:
        if k.name in seen:
            raise ValueError(f"two API keys are named {k.name!r}")
        seen.add(k.name)
    return keys


class ApiKeys:
    """ASGI middleware: HTTP requests outside ``public`` need ``Authorization: Bearer`` with
    one of ``keys`` (``ApiKey`` entries, or bare strings named ``key-N``). A request with a
    valid key, on any path, gets the key's name in ``scope[KEY_SCOPE]``."""

    def __init__(self, app, keys: Iterable[str | ApiKey], public: Iterable[str] = PUBLIC):
        self.app = app
        entries = [k if isinstance(k, ApiKey) else ApiKey(f"key-{i + 1}", k)
                   for i, k in enumerate(keys)]
        if not entries:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [_digest(k.secret) for k in entries]
        self.names = [k.name for k in entries]
        self.public = tuple(public)

    def _open(self, path: str) -> bool:
        return any(path == p or (p.endswith("/") and p != "/" and path.startswith(p))
                   for p in self.public)

    def identify(self, header: bytes | None) -> str | None:
        """The name of the configured key an ``Authorization`` header value carries (None:
        no header, another scheme, or no configured key)."""
        if not header:
            return None
        scheme, _, key = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        d = _digest(key.strip())
        found = -1
        for i, k in enumerate(self._digests):  # every key, whatever matched: no early exit
            if hmac.compare_digest(d, k):
                found = i
        return self.names[found] if found >= 0 else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        header = next((v for k, v in headers if k == b"authorization"), None)
        if header is None:  # Anthropic's clients send the key as x-api-key
            x = next((v for k, v in headers if k == b"x-api-key"), None)
            header = b"Bearer " + x if x is not None else None
        name = self.identify(header)
        if name is not None:
            await self.app({**scope, KEY_SCOPE: name}, receive, send)
            return
        if self._open(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if header:
            msg, code = "Incorrect API key provided.", "invalid_api_key"
        else:
            msg = ("You didn't provide an API key. Send it as 'Authorization: Bearer "
                   "YOUR_KEY' (or 'x-api-key: YOUR_KEY').")
            code = "missing_api_key"
        if scope.get("path", "").startswith("/v1/messages"):  # Anthropic's error shape
            body = json.dumps({"type": "error", "error": {"type": "authentication_error",
                                                          "message": msg}}).encode()
        else:
            body = json.dumps({"error": {"message": msg, "type": "invalid_request_error",
                                         "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="dgr"')]})
        await send({"type": "http.response.body", "body": body})
