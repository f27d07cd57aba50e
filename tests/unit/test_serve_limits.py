"""Limits of the HTTP front (dgr.serve.app), through the ASGI interface over a fake route: the
cap on one API key's generation requests in flight (a 429 in OpenAI's shape with
``Retry-After``, nothing held, the count back to 0 however a request ends: done, refused,
failed, disconnected, cancelled), the bounds on the prompt, ``max_tokens``, ``n`` and ``stop``,
error messages that name no path or endpoint (the detail in the log under the request id),
and ``python -m dgr serve`` refusing a non-loopback ``--host`` without API keys."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import CollectorRegistry
from test_serve_auth import KEYS, bearer
from test_serve_fuzz import FakeRoute, FakeSession, Template, _call  # the fuzz test's fakes

from dgr import errors
from dgr.serve.app import MAX_STOP_CHARS, create_app, per_key_default
from dgr.serve.auth import ApiKey

#: a prompt token that makes the fake generation give one token, then wait for ``route.go``
HOLD = 50
#: a path and an endpoint that must stay out of what a client sees
SECRET_PATH = "/home/operator/.cache/dgr/models/private.gguf"
SECRET_ENDPOINT = "10.20.30.40:50051"


class HeldSession(FakeSession):
    async def generate(self, ids, *, max_tokens, sampling, stop=(), logits=False):
        if ids[-1] != HOLD:
            async for t in super().generate(ids, max_tokens=max_tokens, sampling=sampling,
                                            stop=stop, logits=logits):
                yield t
            return
        yield 1
        await self.route.go.wait()
        for _ in range(max_tokens - 1):
            yield 2


class HeldRoute(FakeRoute):
    """A fake route of ``slots`` slots whose generations of a prompt ending in ``HOLD`` give
    one token and then wait for ``go``."""

    def __init__(self, slots: int = 2):
        super().__init__()
        for s in self.stages:
            s.settings["n_slots"] = slots
        self.go = asyncio.Event()

    def session(self):
        return HeldSession(self)


class Exchange:
    """One request through the ASGI interface, run as a task: its status, headers and body as
    they come, and a client disconnect the test sends when it likes."""

    def __init__(self, app, path: str, body: dict, headers=()):
        raw = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "server": ("test", 80),
                 "client": ("test", 1),
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode()), *headers]}
        self.status: int | None = None
        self.headers: dict = {}
        self.body = b""
        self.gone = asyncio.Event()
        self._first = asyncio.Event()  # the response started and sent a first body chunk
        self._raw: bytes | None = raw
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self):
        if self._raw is not None:
            raw, self._raw = self._raw, None
            return {"type": "http.request", "body": raw, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, msg):
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = {k.decode(): v.decode() for k, v in msg["headers"]}
        elif msg["type"] == "http.response.body":
            self.body += msg.get("body", b"")
            if self.body or not msg.get("more_body", False):
                self._first.set()

    async def started(self) -> Exchange:
        await asyncio.wait_for(self._first.wait(), 10)
        return self

    async def finished(self) -> Exchange:
        await asyncio.wait_for(self.task, 10)
        return self

    def error(self) -> dict:
        return json.loads(self.body)["error"]


def held_stream() -> dict:
    return {"prompt": [1, HOLD], "max_tokens": 4, "stream": True}


COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 3}


def served(route, **kw):
    """The app over ``route`` with KEYS (named alice and key-2) and its metrics registry."""
    reg = CollectorRegistry()
    app = create_app(route, model="m", template=Template(), metrics_registry=reg,
                     api_keys=[ApiKey("alice", KEYS[0]), KEYS[1]], **kw)
    return app, reg


def in_flight(reg, key: str) -> float | None:
    return reg.get_sample_value("dgr_serve_key_requests_in_flight", {"key": key})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# -- the cap on one key's requests in flight ----------------------------------------------------

def test_a_key_over_its_cap_gets_a_429_while_another_key_is_served():
    route = HeldRoute(slots=4)
    app, reg = served(route, max_per_key=2)

    async def go():
        async with app.router.lifespan_context(app):
            held = [await Exchange(app, "/v1/completions", held_stream(),
                                   bearer(KEYS[0])).started() for _ in range(2)]
            assert [h.status for h in held] == [200, 200]
            assert in_flight(reg, "alice") == 2
            opened = route.opened
            over = await Exchange(app, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "hi"}]},
                                  bearer(KEYS[0])).finished()
            assert over.status == 429 and over.headers["retry-after"] == "1"
            err = over.error()
            assert err["type"] == "rate_limit_error" and err["code"] == "max_requests_per_key"
            assert set(err) == {"message", "type", "param", "code"}
            assert KEYS[0] not in over.body.decode()
            # nothing held: no session opened, the count unchanged, both free slots usable
            assert route.opened == opened and in_flight(reg, "alice") == 2
            other = [await Exchange(app, "/v1/completions", COMPLETION,
                                    bearer(KEYS[1])).finished() for _ in range(2)]
            assert [o.status for o in other] == [200, 200]
            assert json.loads(other[0].body)["choices"][0]["text"]
            assert reg.get_sample_value("dgr_serve_key_requests_refused_total",
                                        {"key": "alice"}) == 1
            route.go.set()
            for h in held:
                await h.finished()
                assert h.body.endswith(b"data: [DONE]\n\n")
            assert in_flight(reg, "alice") == 0 and in_flight(reg, "key-2") == 0
            again = await Exchange(app, "/v1/completions", COMPLETION,
                                   bearer(KEYS[0])).finished()
            assert again.status == 200
        assert route.opened == route.closed

    run(go())


async def _end_disconnect(ex: Exchange, route):
    ex.gone.set()
    await ex.finished()


async def _end_cancel(ex: Exchange, route):
    ex.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ex.task


async def _end_done(ex: Exchange, route):
    route.go.set()
    await ex.finished()


@pytest.mark.parametrize("end", [_end_done, _end_disconnect, _end_cancel],
                         ids=["done", "disconnect", "cancelled"])
def test_a_held_stream_gives_its_count_back_however_it_ends(end):
    route = HeldRoute(slots=2)
    app, reg = served(route, max_per_key=1)

    async def go():
        async with app.router.lifespan_context(app):
            ex = await Exchange(app, "/v1/completions", held_stream(), bearer(KEYS[0])).started()
            assert ex.status == 200 and in_flight(reg, "alice") == 1
            await end(ex, route)
            assert in_flight(reg, "alice") == 0
            route.go.set()
            # the cap is 1: a count not given back would refuse this one
            nxt = await Exchange(app, "/v1/completions", COMPLETION, bearer(KEYS[0])).finished()
            assert nxt.status == 200
        assert route.opened == route.closed

    run(go())


@pytest.mark.parametrize("body,status", [
    ({"prompt": [1, 7, 3], "max_tokens": 5}, 503),                  # the route fails
    ({"prompt": [1, 7, 3], "max_tokens": 5, "stream": True}, 200),  # ... mid-stream
    ({"prompt": "x", "max_tokens": 0}, 400),                        # a bad field
    ({"prompt": "x" * 100, "max_tokens": 1}, 400),                  # too long
    ({"prompt": [1, 2], "model": "other"}, 404),
])
def test_a_failed_request_gives_its_count_back(body, status):
    route = HeldRoute(slots=2)
    app, reg = served(route, max_per_key=1)

    async def go():
        async with app.router.lifespan_context(app):
            for _ in range(3):  # a count kept would refuse the second with 429
                ex = await Exchange(app, "/v1/completions", body, bearer(KEYS[0])).finished()
                assert ex.status == status, ex.body
                assert in_flight(reg, "alice") in (None, 0)
        assert route.opened == route.closed

    run(go())


@pytest.mark.parametrize("cancel", [False, True], ids=["timed-out", "cancelled"])
def test_a_request_waiting_for_a_slot_gives_its_count_back(cancel):
    """Key-2 holds the only slot; alice's request waits for it, and either gets the 503 of
    the queue timeout or is cancelled (the server shutting the request down)."""
    route = HeldRoute(slots=1)
    app, reg = served(route, max_per_key=1, queue_timeout=30 if cancel else 0.05)

    async def go():
        async with app.router.lifespan_context(app):
            hog = await Exchange(app, "/v1/completions", held_stream(), bearer(KEYS[1])).started()
            waiter = Exchange(app, "/v1/completions", COMPLETION, bearer(KEYS[0]))
            if cancel:
                for _ in range(100):  # until it is counted (its handler runs)
                    if in_flight(reg, "alice") == 1:
                        break
                    await asyncio.sleep(0)
                assert in_flight(reg, "alice") == 1
                waiter.task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter.task
            else:
                await waiter.finished()
                assert waiter.status == 503 and waiter.error()["code"] == "queue_timeout"
                assert waiter.headers["retry-after"] == "1"
            assert in_flight(reg, "alice") == 0
            route.go.set()
            await hog.finished()
            nxt = await Exchange(app, "/v1/completions", COMPLETION, bearer(KEYS[0])).finished()
            assert nxt.status == 200
        assert route.opened == route.closed

    run(go())


def test_the_default_cap_is_half_the_slots_and_zero_is_none():
    assert [per_key_default(n) for n in (1, 2, 3, 4, 32)] == [1, 1, 1, 2, 16]
    with pytest.raises(ValueError):
        create_app(FakeRoute(), model="m", max_per_key=-1)

    async def three_streams(app, route, headers) -> list[int]:
        async with app.router.lifespan_context(app):
            out = [await Exchange(app, "/v1/completions", held_stream(), headers).started()
                   for _ in range(3)]
            route.go.set()
            for ex in out:
                await ex.finished()
            return [ex.status for ex in out]

    for kw, keys, headers, want in [
            ({}, KEYS, bearer(KEYS[0]), [200, 200, 429]),  # 4 slots: 2 a key
            ({"max_per_key": 0}, KEYS, bearer(KEYS[0]), [200, 200, 200]),
            ({"max_per_key": 1}, None, [], [200, 200, 200])]:  # no keys: no cap
        route = HeldRoute(slots=4)
        app = create_app(route, model="m", template=Template(), api_keys=keys, **kw)
        assert run(three_streams(app, route, headers)) == want, kw
        assert route.opened == route.closed


# -- bounds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens",
     "integer_below_min_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens",
     "integer_below_min_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, "max_completion_tokens",
     "integer_below_min_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 62}, "max_tokens",
     "context_length_exceeded"),  # 3 prompt tokens + 62 > 64
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 30}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * 200}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": list(range(1, 64)) * 2, "max_tokens": 1}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 63}]}, None,
     "context_length_exceeded"),  # no max_tokens: the prompt alone fills the context
    ("/v1/completions", {"prompt": [1, 64]}, "prompt", "invalid_token"),  # n_vocab is 64
    ("/v1/completions", {"prompt": [-1, 2]}, "prompt", "invalid_token"),
    ("/v1/completions", {"prompt": [1, 2 ** 70]}, "prompt", "invalid_token"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n", None),  # more choices than slots
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": -1}, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 10 ** 9}, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n", None),
    ("/v1/completions", {"prompt": "hi", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "s" * (MAX_STOP_CHARS + 1)]}, "stop",
     None),
])
def test_out_of_bounds_requests_get_a_400_naming_the_field(path, body, param, code):
    route = FakeRoute()
    app = create_app(route, model="m", template=Template())

    async def go():
        async with app.router.lifespan_context(app):
            return await _call(app, path, json.dumps(body).encode())

    status, _, raw = run(go())
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error", raw
    assert err["param"] == param and err["code"] == code, err
    assert route.opened == route.closed == 0  # refused before any session


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 61},          # 3 + 61 = 64: the whole context
    {"prompt": [1, 63], "n": 1},
    {"prompt": "hi", "stop": "s" * MAX_STOP_CHARS},
])
def test_requests_at_the_bounds_are_served(body):
    app = create_app(FakeRoute(), model="m", template=Template())

    async def go():
        async with app.router.lifespan_context(app):
            return await _call(app, "/v1/completions", json.dumps(body).encode())

    status, _, raw = run(go())
    assert status == 200, raw


# -- what a remote client sees of a failure ----------------------------------------------------

class FailingRoute(FakeRoute):
    """Tokenizing raises ``exc``; a generation of a prompt with token 7 raises it mid-way."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self.exc = exc

    async def tokenize(self, text, add_special=True, parse_special=False):
        raise self.exc

    def session(self):
        route = self

        class S(FakeSession):
            async def generate(self, ids, **kw):
                yield 9
                raise route.exc

        return S(self)


LEAKY = f"{SECRET_ENDPOINT}: data plane unreachable (open {SECRET_PATH}: denied)"


def _leaks(raw: bytes) -> list[str]:
    text = raw.decode()
    return [s for s in (SECRET_PATH, SECRET_ENDPOINT, "/home/", "denied", "Traceback")
            if s in text]


@pytest.mark.parametrize("exc,status,code", [
    (errors.WorkerUnavailable(LEAKY), 503, "WorkerUnavailable"),
    (errors.ResourceExhausted(LEAKY), 429, "ResourceExhausted"),
    (errors.InvalidArgument(LEAKY), 400, "InvalidArgument"),
    (errors.EngineError(LEAKY), 500, "internal_error"),
    (RuntimeError(LEAKY), 500, "internal_error"),  # not a dgr error
])
@pytest.mark.parametrize("where", ["tokenize", "generate", "stream"])
def test_an_error_shows_the_client_a_request_id_and_the_log_the_detail(exc, status, code, where,
                                                                      caplog):
    route = FailingRoute(exc)
    app = create_app(route, model="m", template=Template())
    body = {"prompt": "hi"} if where == "tokenize" else \
        {"prompt": [1, 7], "stream": where == "stream"}

    async def go():
        async with app.router.lifespan_context(app):
            ex = Exchange(app, "/v1/completions", body)
            try:
                await ex.finished()
            except RuntimeError:  # Starlette re-raises to the server after its 500 answer
                assert isinstance(exc, RuntimeError) and where != "stream"
            return ex

    caplog.set_level(logging.INFO, logger="dgr.serve")
    ex = run(go())
    if where == "stream":
        assert ex.status == 200
        err = json.loads(ex.body.decode().strip().split("\n\n")[-1][6:])["error"]
    else:
        assert ex.status == status, ex.body
        err = ex.error()
    assert err["code"] == code and _leaks(ex.body) == [], ex.body
    assert RuntimeError.__name__ not in ex.body.decode()
    rid = ex.headers["x-request-id"]
    assert f"(request {rid})" in err["message"]
    logged = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert logged and SECRET_PATH in logged[0] and SECRET_ENDPOINT in logged[0], logged
    assert route.opened == route.closed


def test_the_health_probe_without_a_key_names_no_endpoint():
    route = FakeRoute()

    async def down():
        raise errors.WorkerUnavailable(LEAKY)

    route.describe = down
    app = create_app(route, model="m", template=Template(), api_keys=KEYS)

    async def go():
        async with app.router.lifespan_context(app):
            return (await _call(app, "/health", b"", "GET"),
                    await _call(app, "/health", b"", "GET", bearer(KEYS[0])))

    (s1, _, anon), (s2, _, keyed) = run(go())
    assert s1 == s2 == 503
    assert json.loads(anon) == {"status": "unavailable"}
    assert SECRET_ENDPOINT in json.loads(keyed)["error"]  # a key holder sees the detail


# -- python -m dgr serve: no listening beyond loopback without keys ----------------------------

@pytest.fixture()
def serve_cmd(monkeypatch):
    """``python -m dgr serve ... --route`` with uvicorn.run recorded instead of serving: the
    hosts it would have listened on."""
    import uvicorn

    from dgr.cli.commands import main

    ran: list[str] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: ran.append(host))
    monkeypatch.delenv("DGR_API_KEYS", raising=False)
    return lambda *argv: (main(["serve", "--route", "127.0.0.1:1", *argv]), ran)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "myhost"])
def test_serve_beyond_loopback_without_keys_refuses_to_start(serve_cmd, host, capsys):
    rc, ran = serve_cmd("--host", host)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and ran == []
    assert len(err) == 1 and all(w in err[0] for w in ("--api-key-file", "DGR_API_KEYS",
                                                       "--insecure")), err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_serve_on_loopback_needs_nothing(serve_cmd, host):
    rc, ran = serve_cmd("--host", host)
    assert rc == 0 and ran == [host]


def test_serve_beyond_loopback_with_keys_or_insecure_starts(serve_cmd, monkeypatch, caplog):
    rc, ran = serve_cmd("--host", "0.0.0.0", "--insecure")
    assert rc == 0 and ran == ["0.0.0.0"]
    assert any(r.levelno == logging.WARNING and "--insecure" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv("DGR_API_KEYS", "ops sk-dgr-cli-key-0123")
    rc, ran = serve_cmd("--host", "0.0.0.0", "--max-requests-per-key", "3")
    assert rc == 0 and ran == ["0.0.0.0", "0.0.0.0"]
    rc, _ = serve_cmd("--max-requests-per-key", "-1")
    assert rc == 2


@pytest.mark.parametrize("flag", [["--batch-invariant", "on"], ["--ctx", "512"],
                                  ["--device", "Vulkan0"]])
def test_serve_refuses_engine_flags_with_a_route(serve_cmd, flag, capsys):
    # the route's workers keep their own settings: a flag serve would not honour is refused
    rc, ran = serve_cmd(*flag)
    err = capsys.readouterr().err
    assert rc == 2 and ran == [] and flag[0] in err and "python -m dgr.worker" in err
    assert serve_cmd("--batch-invariant", "off")[0] == 0  # the default is no change


def test_serve_prompt_cache_flags(serve_cmd, monkeypatch):
    """--prompt-cache N and --prompt-cache-ttl S reach the app (its pool); bad values stop
    the command before it serves."""
    import dgr.serve.app as app_mod

    made = []
    real = app_mod.create_app
    monkeypatch.setattr(app_mod, "create_app", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    rc, ran = serve_cmd("--prompt-cache", "3", "--prompt-cache-ttl", "7.5", "--no-prefix-store")
    got = made[-1]["settings"]
    assert rc == 0 and (got.prompt_cache, got.prompt_cache_ttl) == (3, 7.5)
    assert not got.prefix_store
    rc, _ = serve_cmd()
    got = made[-1]["settings"]
    assert rc == 0 and got.prompt_cache == 2 and got.prefix_store  # the defaults
    for bad in (("--prompt-cache", "-1"), ("--prompt-cache-ttl", "0")):
        rc, _ = serve_cmd(*bad)
        assert rc == 2, bad


def test_serve_with_local_stages_gives_the_app_its_settings(monkeypatch, tiny_llama):
    """``python -m dgr serve --model M --stages N`` (no --route): the local cluster's engine
    settings and the front's settings are not confused, and the pooling defaults to the
    GGUF's own (a causal model declares none: last)."""
    import types

    import uvicorn

    import dgr.core.engine
    import dgr.serve.app as app_mod
    import dgr.worker.process
    from dgr.cli.commands import main

    started = []

    class FakeCluster:
        def __init__(self, model, ranges, settings=None, args=(), first_args=()):
            started.append((ranges, settings))
            self.workers = []

        def start(self, timeout=None, progress=None):
            return ["127.0.0.1:1", "127.0.0.1:2"]

        def stop(self):
            return [0, 0]

    made = []
    real = app_mod.create_app
    monkeypatch.setattr(dgr.worker.process, "LocalCluster", FakeCluster)
    monkeypatch.setattr(dgr.core.engine, "Engine",
                        lambda *a, **k: types.SimpleNamespace(n_layer=4))
    monkeypatch.setattr(app_mod, "create_app", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: None)
    monkeypatch.delenv("DGR_API_KEYS", raising=False)
    rc = main(["serve", "--model", str(tiny_llama), "--stages", "2", "--ubatch", "32",
               "--prompt-cache", "3"])
    assert rc == 0
    assert started[0][1]["n_ubatch"] == 32  # the engine settings went to the workers
    got = made[-1]["settings"]
    assert got.prompt_cache == 3 and got.pooling == "last"


def test_serve_stops_the_local_workers_when_one_fails_to_start(monkeypatch, tiny_llama, capsys):
    """A local worker that fails to start: serve stops the ones it started, says so, and
    exits with the error's status; nothing is served."""
    import types

    import uvicorn

    import dgr.core.engine
    import dgr.worker.process
    from dgr import errors
    from dgr.cli.commands import main

    stopped, ran = [], []

    class FailingCluster:
        def __init__(self, model, ranges, settings=None, args=(), first_args=()):
            pass

        def start(self, timeout=None, progress=None):
            raise errors.WorkerUnavailable("worker 2/2 exited with status 1 before listening")

        def stop(self):
            stopped.append(True)
            return [0, 1]

    monkeypatch.setattr(dgr.worker.process, "LocalCluster", FailingCluster)
    monkeypatch.setattr(dgr.core.engine, "Engine",
                        lambda *a, **k: types.SimpleNamespace(n_layer=4))
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: ran.append(host))
    monkeypatch.delenv("DGR_API_KEYS", raising=False)
    rc = main(["serve", "--model", str(tiny_llama), "--stages", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and ran == [] and stopped == [True]
    assert "workers stopped (exit status 0, 1)" in err and "before listening" in err, err
