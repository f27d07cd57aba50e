"""API keys on the HTTP front (dgr.serve.auth): OpenAI's Bearer header, a 401 in OpenAI's
shape for a missing or wrong key on every data path, the health probe and the status page's
files public (the probe without a key says only its status), keys named in the key file, and
keys never echoed."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_serve_fuzz import FakeRoute, Template, _call  # the fuzz test's fakes

from dgr.serve.app import create_app
from dgr.serve.auth import ApiKey, ApiKeys, load_keys

KEYS = ["sk-dgr-first-0123456789", "sk-dgr-second-abcdefghij"]


async def call(app, method: str, path: str, headers=(), body: bytes = b"") -> dict:
    status, hdrs, out = await _call(app, path, body, method, headers)
    return {"status": status, "headers": hdrs, "body": out}


def bearer(key: str):
    return [(b"authorization", f"Bearer {key}".encode())]


COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


@pytest.fixture()
def app():
    return create_app(FakeRoute(), model="m", template=Template(), api_keys=KEYS)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user",
                                                              "content": "hi"}]}).encode()),
    ("GET", "/v1/models", b""), ("GET", "/status", b""), ("GET", "/metrics", b""),
])
@pytest.mark.parametrize("headers,code", [
    ([], "missing_api_key"),
    (bearer("sk-dgr-wrong-0000000000"), "invalid_api_key"),
    (bearer(KEYS[0][:-1]), "invalid_api_key"),  # a prefix of a key is not the key
    ([(b"authorization", f"Basic {KEYS[0]}".encode())], "invalid_api_key"),
    ([(b"authorization", b"Bearer ")], "invalid_api_key"),
])
def test_a_request_without_a_right_key_gets_a_401(app, method, path, body, headers, code):
    out = run(call(app, method, path, headers, body))
    assert out["status"] == 401
    assert out["headers"]["www-authenticate"].startswith("Bearer")
    err = json.loads(out["body"])["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error"
    assert all(k not in out["body"].decode() for k in KEYS)  # never echoed


@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_path(app, key):
    async def go():
        async with contextlib_lifespan(app):
            r = await call(app, "POST", "/v1/completions", bearer(key), COMPLETION)
            assert r["status"] == 200 and json.loads(r["body"])["choices"]
            r = await call(app, "GET", "/v1/models", [(b"authorization", f"bearer {key}".encode())])
            assert r["status"] == 200  # the scheme is case-insensitive

    run(go())


def test_the_health_probe_and_the_page_are_public(app):
    async def go():
        async with contextlib_lifespan(app):
            r = await call(app, "GET", "/health")
            # without a key: the status only, no stage endpoints; with one: the whole record
            assert r["status"] == 200 and json.loads(r["body"]) == {"status": "ok"}
            r = await call(app, "GET", "/health", bearer(KEYS[1]))
            assert r["status"] == 200 and set(json.loads(r["body"])) >= {"stages", "capacity"}
            page = await call(app, "GET", "/")
            assert page["status"] == 200 and b"api-key" in page["body"]
            assert (await call(app, "GET", "/static/status.js"))["status"] == 200
            assert (await call(app, "GET", "/statusx"))["status"] == 401  # not a prefix match

    run(go())


def test_without_keys_nothing_is_asked():
    a = create_app(FakeRoute(), model="m", template=Template())

    async def go():
        async with contextlib_lifespan(a):
            assert (await call(a, "POST", "/v1/completions", [], COMPLETION))["status"] == 200

    run(go())


def test_load_keys_reads_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the team's keys\nsk-dgr-file-key-1\n\n  sk-dgr-file-key-2  \n"
                 "alice\tsk-dgr-file-key-3\n")
    keys = load_keys(str(f), "sk-dgr-env-key-1, bob sk-dgr-env-key-2,")
    assert [(k.name, k.secret) for k in keys] == [
        ("key-1", "sk-dgr-file-key-1"), ("key-2", "sk-dgr-file-key-2"),
        ("alice", "sk-dgr-file-key-3"), ("key-4", "sk-dgr-env-key-1"),
        ("bob", "sk-dgr-env-key-2")]
    assert all(k.secret not in repr(keys) for k in keys)  # a logged list shows names only
    assert load_keys(None, None) == []
    # (an entry, its secret parts): a short key, three fields, a bad name, a short named key,
    # two keys named key-1
    for bad, secrets in [("tiny7", ["tiny7"]), ("has space inside", ["space", "inside"]),
                         ("al/ice sk-dgr-secret-1", ["sk-dgr-secret-1"]),
                         ("carol tiny7", ["tiny7"]),
                         ("sk-dgr-secret-1,key-1 sk-dgr-secret-2",
                          ["sk-dgr-secret-1", "sk-dgr-secret-2"])]:
        with pytest.raises(ValueError) as e:
            load_keys(None, bad)
        assert not any(x in str(e.value) for x in secrets), e.value  # the place, not the key
    with pytest.raises(ValueError):
        ApiKeys(None, [])


def test_a_request_carries_the_name_of_its_key():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope.get("dgr.api_key"))

    mw = ApiKeys(inner, [ApiKey("alice", KEYS[0]), KEYS[1]])  # a bare string is key-2
    scope = {"type": "http", "path": "/v1/models"}
    for key in KEYS:
        run(mw({**scope, "headers": bearer(key)}, None, None))
    run(mw({"type": "http", "path": "/health", "headers": []}, None, None))  # public, no key
    assert seen == ["alice", "key-2", None]


class contextlib_lifespan:
    """Runs the app's lifespan startup and shutdown around the block (as uvicorn does)."""

    def __init__(self, app):
        self.app = app

    async def __aenter__(self):
        self.q: asyncio.Queue = asyncio.Queue()
        self.out: asyncio.Queue = asyncio.Queue()
        await self.q.put({"type": "lifespan.startup"})
        self.task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                                   self.q.get, self.out.put))
        msg = await asyncio.wait_for(self.out.get(), 10)
        assert msg["type"] == "lifespan.startup.complete", msg
        return self

    async def __aexit__(self, *exc):
        await self.q.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(self.out.get(), 10)
        await asyncio.wait_for(self.task, 10)
