"""API keys for the HTTP front: OpenAI's ``Authorization: Bearer <key>`` (docs/serve.md).

``ApiKeys`` is an ASGI middleware. With keys configured (``python -m dgr serve
--api-key-file FILE`` or ``DGR_API_KEYS``), every request except ``PUBLIC`` needs one of the
keys, or it gets a 401 in OpenAI's error shape, with ``WWW-Authenticate: Bearer``. The public
paths are the health probe and the status page's own files, which hold no data; the page asks
for a key when its ``/status`` request is refused. A key is compared in constant time against
every configured key (``hmac.compare_digest`` of SHA-256 digests), and is never logged or
echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

__all__ = ["ApiKeys", "PUBLIC", "load_keys"]

#: paths served without a key: the health probe, the status page and its static files
PUBLIC = ("/health", "/", "/static/")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_keys(path: str | None = None, env: str | None = None) -> list[str]:
    """Keys from ``path`` (one a line; blank lines and lines starting with ``#`` skipped)
    and from ``env`` (the value of ``DGR_API_KEYS``: comma-separated).

    Raises
    ------
    OSError
        ``path`` cannot be read.
    ValueError
        A key with whitespace inside or shorter than 8 characters.
    """
    keys: list[str] = []
    if path:
        with open(path, encoding="utf-8") as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if env:
        keys += [k.strip() for k in env.split(",") if k.strip()]
    for i, k in enumerate(keys):
        if len(k) < 8 or any(c.isspace() for c in k):
            raise ValueError(f"API key {i + 1} is shorter than 8 characters or holds whitespace")
    return keys


class ApiKeys:
    """ASGI middleware: HTTP requests outside ``public`` need ``Authorization: Bearer`` with
    one of ``keys``."""

    def __init__(self, app, keys: Iterable[str], public: Iterable[str] = PUBLIC):
        self.app = app
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")
        self.public = tuple(public)

    def _open(self, path: str) -> bool:
        return any(path == p or (p.endswith("/") and p != "/" and path.startswith(p))
                   for p in self.public)

    def allows(self, header: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries a configured key."""
        if not header:
            return False
        scheme, _, key = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        d = _digest(key.strip())
        ok = False
        for k in self._digests:  # every key, whatever matched: no early exit to time
            ok |= hmac.compare_digest(d, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self._open(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.allows(header):
            await self.app(scope, receive, send)
            return
        if header:
            msg, code = "Incorrect API key provided.", "invalid_api_key"
        else:
            msg = ("You didn't provide an API key. Send it as 'Authorization: Bearer "
                   "YOUR_KEY'.")
            code = "missing_api_key"
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="dgr"')]})
        await send({"type": "http.response.body", "body": body})
