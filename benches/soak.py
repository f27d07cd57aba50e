"""A soak: mixed load, random faults and bad clients against a local multi-stage route of real
worker processes, for a set time; every legitimate session's tokens checked.

    python benches/soak.py [--duration 120] [--sessions 24] [--stages 3] [--seed 1]
                           [--json out.json] [--model PATH] [--secure]

Setup. ``--stages`` ``python -m dgr.worker`` processes on loopback (``LocalCluster``, as
``python -m dgr run`` starts them) serve even layer ranges of the model (default: the
registry's, SmolLM2-135M Q4_1) with :data:`SETTINGS` (one thread per stage, ``n_ubatch`` 32,
flash attention) and the extra arguments of :func:`worker_args` (a short session TTL and frame
deadline, explicit data-plane connection caps, a relay allowlist of 127.0.0.1 only). While
they load, the whole model in this process (``dgr.Engine``, the same settings) computes the
greedy reference of ``--prompts`` seeded random prompts (4-48 token ids), ``MAX_TOKENS``
tokens each, once (``generate_local``, ``stop_on_eog=False``).

Load. ``--sessions`` lanes run at once until ``--duration`` has passed; each runs one session
after another, each on one of three shared routes (:data:`PATHS`: direct relay with the decode
loop, direct relay one step per token, gRPC hop by hop), a random prompt and ``max_tokens``
(1..32), and with probability ``--early`` stops reading after a random number of tokens and
releases the session early. Batching stays on (the workers' default and
``AsyncRoute(batching=True)``): docs/batching.md measured SmolLM2's batched rows bit-identical
to solo rows at one thread per stage with chunks under 64 rows and under 512 KV cells, which
these settings keep (``n_ubatch`` 32, ``n_ctx`` 128), so every session must produce exactly its
prompt's reference prefix. A session is *completed* when it did; *wrong* when its tokens
differ; *lost* when it raised anything (a legitimate session must never fail; recoveries
inside the driver are allowed and counted) or did not finish within ``SESSION_TIMEOUT``.

Faults and bad clients, one started every 0.3-1.5 s (at most ``FAULTS_AT_ONCE`` at a time),
drawn from a shuffled deck that holds each kind :data:`WEIGHTS` times (so every kind comes up
in each pass of the deck), each with the answer it was designed to get (anything else counts
as *unexpected*):

- ``driver_drop``: a driver of its own (an ``AsyncRoute``) starts a generation, its task is
  cancelled after a random number of tokens and the route closed without releasing the
  session: every stage must drop it by itself (TTL expiry or eviction; checked at the end).
- ``cut_close``: a data connection sends a length prefix and part of a frame, then closes
  (or resets); the worker must serve the next connection.
- ``cut_stall``: the same, then silence: ``FrameTruncated`` and a close within
  ``--frame-timeout`` (plus ``SLACK`` s).
- ``slowloris``: a length prefix (or only its first bytes) then one byte at a time, each well
  within the deadline: cut off within the deadline (``FrameTruncated``, a close or a reset).
- ``data_garbage``: a length-prefixed frame of random bytes: a ``FrameError`` reply, and the
  connection keeps serving (its ``Hello`` is echoed after).
- ``data_bad_header``: a frame whose prefix and checksum are valid but whose msgpack header
  is not a valid message: a typed error reply (not the internal code 100), connection kept.
- ``data_wrong_model``: a well-formed ``Forward`` naming another model: ``ModelMismatch``.
- ``data_oversize``: a length prefix over ``MAX_FRAME``: ``FrameTooLarge`` and a close.
- ``grpc_garbage``, ``grpc_bad_header``: the same garbage and bad header on a gRPC ``Step``
  stream: a typed error reply.
- ``relay_stranger``: a relayed ``Forward`` whose ``relay`` names a port of this process on
  127.0.0.9 (off the allowlist): ``RelayRefused`` and no connection to that port.
- ``flood``: ``--flood-cap`` + ``FLOOD_EXTRA`` connections at once from one address to one
  worker's data port, capped at ``--flood-cap`` per address: the rest refused with
  ``ResourceExhausted``, the served ones echo a ``Hello``.

With ``--secure`` the workers take cluster credentials (a peer one for themselves, a tenant
one for the drivers) and mutual TLS on both planes, every client above presents the tenant's
credential and certificate (an authenticated abuser), and four more kinds come in:

- ``auth_missing``: a data connection without the authentication frame: one
  ``Unauthenticated`` and the close;
- ``auth_wrong``: its first frame signed with a wrong secret, by an unknown name, or no
  token at all: the same;
- ``auth_replay``: a captured authentication frame replayed on a second connection: the
  first connection is served, the replay refused;
- ``grpc_unauthenticated``: gRPC calls without the credential or with a wrong one:
  ``Unauthenticated`` (health stays public and says SERVING).

Bad clients use their own sockets (the gRPC ones a ``ShardClient`` channel of their own), the
data-plane ones bound to loopback source addresses of their own (127.0.0.2 and up;
:data:`SOURCES`), so the per-address caps they meet never apply to the
legitimate drivers (127.0.0.1); they only ever connect to the workers' loopback ports.

Measured: sessions started/completed/lost/wrong (by path, early releases, recoveries, tokens),
the faults and their answers, each worker's resident memory (``VmRSS`` of
``/proc/PID/status``) every ``--sample-every`` s from the start of the load (after one
warm-up session per path) to the end (after every session was released or expired), and the
sessions left on the workers. After the load: the sessions of every stage must drop to zero
within the TTL, then one checked session per path. A progress line every 10 s on stderr; a
summary on stdout; ``--json`` writes the figures and the RSS series. Exit status 1 when a
session was lost or wrong, a worker died, sessions leaked or a bad client got an unexpected
answer; 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import struct
import sys
import time
import uuid

import msgspec

from harness import cli

#: Numeric settings of every worker and of the reference (docs/batching.md: one thread per
#: stage and chunks under 64 rows keep batched rows bit-identical on SmolLM2's quant). No more
#: slots than ``n_ubatch``: an engine with more aborts in llama.cpp (``n_outputs_max``).
SETTINGS = dict(n_ctx=128, n_slots=32, n_threads=1, n_ubatch=32, flash_attn=True)
#: Longest generation of a session (the reference's length); prompts are 4..48 tokens.
MAX_TOKENS = 32
MAX_PROMPT = 48
#: The shared routes' configurations: direct relay with the decode loop, direct relay one
#: step per token, the gRPC path (the driver relays every boundary).
PATHS = {"relay+loop": dict(relay=True, loop=True), "relay": dict(relay=True, loop=False),
         "grpc": dict(relay=False)}
#: A session not finished within this many seconds is lost.
SESSION_TIMEOUT = 180.0
#: Bound of a bad client's wait on a worker beyond the deadline it tests, seconds.
SLACK = 5.0
#: Bound of a connect, a send or a reply a bad client waits for, seconds.
WAIT = 30.0
FAULTS_AT_ONCE = 3
FLOOD_EXTRA = 8
#: The faults and bad clients (``BadClients`` methods), how often each is drawn, and the
#: loopback source address of each data-plane kind (its own per-address cap on the worker;
#: the gRPC ones use a ``ShardClient`` channel of their own).
KINDS = ("driver_drop", "cut_close", "cut_stall", "slowloris", "data_garbage",
         "data_bad_header", "data_wrong_model", "data_oversize", "grpc_garbage",
         "grpc_bad_header", "relay_stranger", "flood")
#: the kinds ``--secure`` adds: callers without the credential, with a wrong one, or
#: replaying a captured authentication frame
SECURE_KINDS = ("auth_missing", "auth_wrong", "auth_replay", "grpc_unauthenticated")
SOURCES = ({k: f"127.0.0.{10 + i}" for i, k in enumerate(KINDS + SECURE_KINDS)}
           | {"flood": "127.0.0.2"})
WEIGHTS = {"driver_drop": 3, "cut_close": 2, "cut_stall": 2, "slowloris": 1,
           "data_garbage": 2, "data_bad_header": 2, "data_wrong_model": 1, "data_oversize": 1,
           "grpc_garbage": 1, "grpc_bad_header": 1, "relay_stranger": 1, "flood": 1,
           "auth_missing": 1, "auth_wrong": 1, "auth_replay": 1, "grpc_unauthenticated": 1}
#: 127.0.0.9 is loopback too, but not on the workers' relay allowlist (127.0.0.1 only)
STRANGER = "127.0.0.9"
_PREFIX = struct.Struct("<4sBBHII")


def say(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# -- the one place the route's processes and drivers are configured -----------------------------


def worker_args(opts: argparse.Namespace) -> list[str]:
    """The extra command-line arguments of every worker (``python -m dgr.worker``) beyond the
    model, layers, listen address and :data:`SETTINGS`; with ``--secure`` the cluster's
    credentials and mutual TLS (:func:`secure_files`)."""
    args = ["--ttl", f"{opts.ttl:g}", "--frame-timeout", f"{opts.frame_timeout:g}",
            "--max-data-connections", str(opts.max_connections),
            "--max-data-connections-per-address", str(opts.flood_cap),
            "--relay-allow", "127.0.0.1", "--log-level", "INFO"]
    if opts.secure:
        f = opts.files
        args += ["--cluster-keys", f["keys"], "--tls-cert", f["node"], "--tls-key",
                 f["node_key"], "--tls-ca", f["ca"], "--tls-client-auth"]
    return args


def route_options(opts: argparse.Namespace, path: str) -> dict:
    """``AsyncRoute`` keyword arguments of a driver on ``path`` (one of :data:`PATHS`); with
    ``--secure`` the tenant's credential and client certificate."""
    return dict(PATHS[path], batching=True, security=client_security(opts))


def client_security(opts: argparse.Namespace):
    """What every client of the soak presents (``dgr.transport.security.Security``): with
    ``--secure`` the tenant credential and a client certificate; else nothing."""
    from dgr.transport.security import Security, TLSConfig

    if not opts.secure:
        return Security()
    f = opts.files
    return Security(opts.tenant, None, TLSConfig(cert=f["client"], key=f["client_key"],
                                                 ca=f["ca"]))


def secure_files(opts: argparse.Namespace, directory: str) -> None:
    """``--secure``: a throwaway CA, a certificate for the workers (127.0.0.1, server and
    client) and one for the clients, and a credentials file with a peer credential for the
    workers and a tenant one for the drivers (random secrets), in ``directory``; sets
    ``opts.files`` and ``opts.tenant``."""
    import secrets

    try:
        import trustme
    except ImportError:
        raise SystemExit("--secure needs trustme (pip install trustme; in the test extras)")
    from dgr.transport.security import parse_credentials

    ca = trustme.CA()
    node, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("soak-client")
    files = {"ca": ca.cert_pem, "node": node.cert_chain_pems[0],
             "node_key": node.private_key_pem, "client": client.cert_chain_pems[0],
             "client_key": client.private_key_pem}
    opts.files = {}
    for name, blob in files.items():
        path = os.path.join(directory, f"{name}.pem")
        blob.write_to_path(path)
        opts.files[name] = path
    text = f"workers {secrets.token_hex(16)} peer\nsoak {secrets.token_hex(16)}\n"
    opts.files["keys"] = os.path.join(directory, "cluster.keys")
    with open(os.open(opts.files["keys"], os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(text)
    opts.tenant = parse_credentials(text)[1]


def kinds_of(opts: argparse.Namespace) -> tuple[str, ...]:
    """The fault kinds this run draws from."""
    return KINDS + SECURE_KINDS if opts.secure else KINDS


# -- figures ------------------------------------------------------------------------------------


class Tally:
    """Everything counted while the soak runs."""

    def __init__(self, early: float, kinds: tuple[str, ...] = KINDS):
        #: the fraction of sessions released before their ``max_tokens``
        self.early = early
        self.sessions = collections.Counter()       # started, completed, lost, wrong, ...
        self.by_path = {p: collections.Counter() for p in PATHS}
        self.problems: list[dict] = []              # lost and wrong sessions (the first ones)
        self.faults = {k: {"count": 0, "answers": collections.Counter(), "unexpected": 0,
                           "details": []} for k in kinds}
        self.dropped: list[str] = []                # session ids of driver_drop
        self.cut_s: list[float] = []                # how long a stall/slowloris was held
        self.tokens = 0
        self.in_flight = 0
        #: the errors the shared routes' recoveries repaired, by class
        self.recovered = collections.Counter()

    def problem(self, what: str, **info) -> None:
        if len(self.problems) < 20:
            self.problems.append({"what": what, **info})

    def fault(self, kind: str, answer: str, ok: bool, detail: str = "") -> None:
        f = self.faults[kind]
        f["count"] += 1
        f["answers"][answer] += 1
        if not ok:
            f["unexpected"] += 1
            if len(f["details"]) < 5:
                f["details"].append(f"{answer}: {detail}"[:400])


def count_recoveries(route, tally: Tally) -> None:
    """Count, by error class, what ``route``'s recovery repairs (it logs nothing itself)."""
    recover = route.recovery.recover

    async def counted(s, err, attempt=1):
        tally.recovered[type(err).__name__] += 1
        return await recover(s, err, attempt)

    route.recovery.recover = counted


def rss_kb(pid: int) -> int | None:
    """``VmRSS`` of process ``pid`` in kB (None: gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# -- the legitimate load ------------------------------------------------------------------------


async def one_session(routes, refs, prompts, tally: Tally, rng: random.Random, path: str,
                      label: str = "") -> None:
    """One checked session on ``routes[path]``: a random prompt and ``max_tokens``, perhaps
    released early; counts it completed, wrong or lost."""
    p = rng.randrange(len(prompts))
    m = rng.randint(1, MAX_TOKENS)
    early = rng.randint(1, m - 1) if m > 1 and rng.random() < tally.early else None
    route = routes[path]
    s = route.session()
    toks: list[int] = []
    tally.sessions["started"] += 1
    tally.by_path[path]["started"] += 1
    tally.in_flight += 1

    async def run():
        gen = s.generate(prompts[p], max_tokens=m, stop_on_eog=False)
        try:
            async for t in gen:
                toks.append(t)
                tally.tokens += 1
                if early is not None and len(toks) >= early:
                    break
        finally:
            await gen.aclose()

    try:
        try:
            await asyncio.wait_for(run(), SESSION_TIMEOUT)
        finally:
            await asyncio.wait_for(s.close(), WAIT)
    except Exception as e:  # noqa: BLE001 - a legitimate session must never fail: count it
        tally.sessions["lost"] += 1
        tally.by_path[path]["lost"] += 1
        tally.problem("lost", path=path, prompt=p, max_tokens=m, early=early, label=label,
                      tokens=len(toks), error=f"{type(e).__name__}: {e}"[:400])
        return
    finally:
        tally.in_flight -= 1
    tally.sessions["recoveries"] += s.recoveries
    want = refs[p][:early if early is not None else m]
    if toks != want:
        tally.sessions["wrong"] += 1
        tally.by_path[path]["wrong"] += 1
        at = next((i for i, (a, b) in enumerate(zip(toks, want)) if a != b), min(len(toks),
                                                                                   len(want)))
        tally.problem("wrong", path=path, prompt=p, max_tokens=m, early=early, label=label,
                      first_difference=at, got=toks, want=want)
        return
    tally.sessions["completed"] += 1
    tally.by_path[path]["completed"] += 1
    if early is not None:
        tally.sessions["released_early"] += 1


async def lane(i: int, opts, routes, refs, prompts, tally: Tally, t_end: float) -> None:
    rng = random.Random(f"{opts.seed}-lane-{i}")
    while time.monotonic() < t_end:
        await one_session(routes, refs, prompts, tally, rng, rng.choice(list(PATHS)))


# -- bad clients --------------------------------------------------------------------------------


class Raw:
    """A bad client's own TCP connection to a worker port, from loopback address ``source``;
    under ``--secure`` TLS with the tenant's client certificate, and (unless ``auth`` is
    False or an ``auth`` frame is given) a valid authentication frame first."""

    #: ``Security`` of the bad clients (``BadClients`` sets it)
    security = None

    @classmethod
    async def open(cls, endpoint: str, source: str, auth: bool | bytes = True) -> Raw:
        from dgr.transport.dataplane import LEN, split_endpoint

        host, port = split_endpoint(endpoint)
        self = cls()
        sec = cls.security
        ctx = sec.client_context() if sec is not None else None
        tls = {"ssl": ctx, "server_hostname": host} if ctx is not None else {}
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=(source, 0), **tls), WAIT)
        frame = auth if isinstance(auth, bytes) else (
            sec.auth_frame() if auth and sec is not None else None)
        if frame is not None:
            await self.send(LEN.pack(len(frame)) + frame)
        return self

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), WAIT)

    async def frame(self, timeout: float = WAIT):
        """The next frame's header, None at a clean end of stream; raises TimeoutError (no
        answer in time) or ConnectionError (a reset)."""
        from dgr.protocol import wire
        from dgr.transport.dataplane import LEN

        try:
            (n,) = LEN.unpack(await asyncio.wait_for(self.reader.readexactly(LEN.size), timeout))
            data = await asyncio.wait_for(self.reader.readexactly(n), timeout)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise ConnectionError(f"closed inside a frame ({len(e.partial)} bytes)") from None
        return wire.decode(data).header

    async def hello(self, route: str = "") -> str:
        """Send a ``Hello``; the answer's label ("Hello echoed" when served)."""
        from dgr.protocol import wire
        from dgr.transport.dataplane import LEN

        route = route or uuid.uuid4().hex
        f = wire.encode(wire.Hello(route=route))
        await self.send(LEN.pack(len(f)) + f)
        h = await self.frame()
        return "Hello echoed" if h == wire.Hello(route=route) else label(h)

    def close(self, reset: bool = False) -> None:
        if reset:
            self.writer.transport.abort()
        else:
            self.writer.close()


def label(h) -> str:
    """A reply's label: the error class of an ``ErrorReply``, the message type, or EOF."""
    from dgr.protocol import wire

    if h is None:
        return "closed"
    if type(h) is wire.ErrorReply:
        return f"ErrorReply {type(h.to_exception()).__name__}"
    return type(h).__name__


def error_of(h):
    """The exception of an ``ErrorReply`` header (None for anything else)."""
    from dgr.protocol import wire

    return h.to_exception() if type(h) is wire.ErrorReply else None


def resign(header: list, payload: bytes = b"") -> bytes:
    """A frame of a (malformed) msgpack header list with a valid prefix and header sum."""
    from dgr.testing.wirefuzz import resign as signed

    return signed(header, payload, fix_checksum=False)


class BadClients:
    """The faults and bad clients of :data:`KINDS`, against the workers of ``stages``."""

    def __init__(self, opts, stages, endpoints, prompts, refs, tally: Tally):
        self.opts = opts
        self.stages = stages
        self.endpoints = endpoints
        self.prompts = prompts
        self.refs = refs
        self.tally = tally
        self.flood_lock = asyncio.Lock()
        self.n = 0
        #: what a bad client presents: the tenant's credential and certificate under
        #: ``--secure`` (an authenticated abuser), else nothing
        self.security = client_security(opts)
        Raw.security = self.security

    def forward(self, st, session: str, toks, **kw) -> bytes:
        """A well-formed first-stage-style ``Forward`` of ``toks`` for stage ``st``."""
        from dgr.protocol import wire

        return wire.encode(wire.Forward(
            model=kw.pop("model", st.identity), session=session, epoch=1, first_pos=0,
            n_tokens=len(toks), layer=st.layers[0], tokens=list(toks), want="token", **kw))

    def bad_header(self, rng: random.Random) -> bytes:
        """A frame with a valid prefix and header sum whose msgpack header is no valid
        message: an unknown tag, too few items, a required field of the wrong type or out of
        range, a zero-token step, or no array at all."""
        f = self.forward(self.stages[0], "bad", [1, 2, 3])
        good = msgspec.msgpack.decode(f[16:16 + _PREFIX.unpack_from(f)[4]])
        # Forward's items: [tag, schema, model, session, epoch, first_pos, n_tokens, layer, ...]
        wrong = {2: [7, None, [1]], 3: [7, None, {"k": 1}], 4: [-7, "x", 2 ** 64 - 1],
                 5: [-7, "x", 3.5], 6: [0, -1, "x"], 7: [-7, "x", [2]]}
        choice = rng.randrange(4)
        if choice == 0:
            h = [99] + good[1:]
        elif choice == 1:
            h = good[:rng.randint(0, 6)]
        elif choice == 2:
            h = list(good)
            at = rng.choice(list(wrong))
            h[at] = rng.choice(wrong[at])
        else:
            h = {"not": "an array"}
        return resign(h)

    async def run(self, kind: str, rng: random.Random) -> None:
        self.n += 1
        try:
            answer, ok, detail = await asyncio.wait_for(
                getattr(self, kind)(rng), 3 * self.opts.frame_timeout + 3 * WAIT)
        except Exception as e:  # noqa: BLE001 - an answer it was not designed for
            answer, ok, detail = f"{type(e).__name__}", False, str(e)
        self.tally.fault(kind, answer, ok, detail)

    # each returns (answer, as designed?, detail)

    async def driver_drop(self, rng):
        from dgr.driver.route import AsyncRoute

        path = rng.choice(list(PATHS))
        p = rng.randrange(len(self.prompts))
        k = rng.randint(1, MAX_TOKENS - 1)
        r = AsyncRoute(self.endpoints, **route_options(self.opts, path))
        got: list[int] = []
        try:
            await asyncio.wait_for(r.connect(), WAIT)
            s = r.session(f"drop-{uuid.uuid4().hex[:12]}")
            self.tally.dropped.append(s.id)

            async def gen():
                async for t in s.generate(self.prompts[p], max_tokens=MAX_TOKENS,
                                          stop_on_eog=False):
                    got.append(t)

            task = asyncio.create_task(gen())
            deadline = time.monotonic() + SESSION_TIMEOUT
            while len(got) < k and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            task.cancel()
            done = await asyncio.gather(task, return_exceptions=True)
        finally:
            await r.close()  # no release: the driver is gone
        if got != self.refs[p][:len(got)]:
            return "wrong tokens before the drop", False, f"{got} vs {self.refs[p]}"
        if isinstance(done[0], asyncio.CancelledError):
            return f"cancelled mid-generation ({path})", True, ""
        if done[0] is None:
            return f"completed before the drop ({path})", True, ""
        return f"failed: {type(done[0]).__name__}", False, str(done[0])

    def _data(self, rng):
        st = rng.choice(self.stages)
        return st, st.data_endpoint

    async def _answer_then_hello(self, kind: str, ep: str, frame: bytes):
        """Send ``frame`` on a connection of its own: the reply's header, and the label of
        a ``Hello`` sent after it ("Hello echoed" when the connection kept serving)."""
        from dgr.transport.dataplane import LEN

        c = await Raw.open(ep, SOURCES[kind])
        try:
            await c.send(LEN.pack(len(frame)) + frame)
            return await c.frame(), await c.hello()
        finally:
            c.close()

    async def _partial(self, rng, kind: str):
        from dgr.transport.dataplane import LEN

        st, ep = self._data(rng)
        f = self.forward(st, f"cut-{self.n}", self.prompts[0][:8])
        c = await Raw.open(ep, SOURCES[kind])
        at = rng.randrange(1, len(f))
        await c.send(LEN.pack(len(f)) + f[:at])
        return c, ep, at, len(f)

    async def cut_close(self, rng):
        c, ep, at, n = await self._partial(rng, "cut_close")
        reset = rng.random() < 0.5
        c.close(reset=reset)
        d = await Raw.open(ep, SOURCES["cut_close"])
        try:
            a = await d.hello()
        finally:
            d.close()
        how = "reset" if reset else "closed"
        return f"{how} mid-frame; next connection: {a}", a == "Hello echoed", f"{at}/{n} bytes"

    async def cut_stall(self, rng):
        c, ep, at, n = await self._partial(rng, "cut_stall")
        t0 = time.monotonic()
        try:
            h = await c.frame(self.opts.frame_timeout + SLACK)
            held = time.monotonic() - t0
            end = await c.frame(SLACK)
        finally:
            c.close()
        self.tally.cut_s.append(held)
        ok = type(error_of(h)).__name__ == "FrameTruncated" and end is None \
            and held <= self.opts.frame_timeout + SLACK
        return f"{label(h)}, then {label(end)}", ok, f"{at}/{n} bytes, held {held:.2f} s"

    async def slowloris(self, rng):
        from dgr.transport.dataplane import LEN

        st, ep = self._data(rng)
        c = await Raw.open(ep, SOURCES["slowloris"])
        pre = LEN.pack(rng.randint(64, 4096))
        inside = rng.random() < 0.3
        first = pre[:rng.randint(1, 3)] if inside else pre
        every = self.opts.frame_timeout / 5
        t0 = time.monotonic()
        answer = None
        try:
            await c.send(first)
            while time.monotonic() - t0 < self.opts.frame_timeout + SLACK:
                try:
                    answer = label(await c.frame(every))
                    break
                except TimeoutError:
                    pass
                except ConnectionError:
                    answer = "reset"
                    break
                try:
                    await c.send(b"\x00")
                except (ConnectionError, OSError):
                    answer = "reset"
                    break
        finally:
            c.close()
        held = time.monotonic() - t0
        self.tally.cut_s.append(held)
        where = "in the length" if inside else "in the frame"
        ok = answer in ("ErrorReply FrameTruncated", "closed", "reset")
        return f"{answer or 'not cut off'} ({where})", ok, f"held {held:.2f} s"

    async def data_garbage(self, rng):
        from dgr import errors

        st, ep = self._data(rng)
        body = rng.randbytes(rng.randint(0, 2048))
        h, kept = await self._answer_then_hello("data_garbage", ep, body)
        ok = isinstance(error_of(h), errors.FrameError) and kept == "Hello echoed"
        return f"{label(h)}; {kept}", ok, f"{len(body)} random bytes"

    async def data_bad_header(self, rng):
        from dgr import errors

        st, ep = self._data(rng)
        h, kept = await self._answer_then_hello("data_bad_header", ep, self.bad_header(rng))
        e = error_of(h)
        ok = e is not None and type(e) is not errors.DgrError and kept == "Hello echoed"
        return f"{label(h)}; {kept}", ok, str(e)

    async def data_wrong_model(self, rng):
        from dgr import errors

        st, ep = self._data(rng)
        f = self.forward(st, f"wrong-model-{self.n}", self.prompts[1][:6], model="not-a-model")
        h, kept = await self._answer_then_hello("data_wrong_model", ep, f)
        ok = type(error_of(h)) is errors.ModelMismatch and kept == "Hello echoed"
        return f"{label(h)}; {kept}", ok, ""

    async def data_oversize(self, rng):
        from dgr.transport.dataplane import LEN, MAX_FRAME

        st, ep = self._data(rng)
        c = await Raw.open(ep, SOURCES["data_oversize"])
        try:
            await c.send(LEN.pack(rng.randint(MAX_FRAME + 1, 2 ** 32 - 1)))
            h = await c.frame()
            end = await c.frame(SLACK)
        finally:
            c.close()
        ok = type(error_of(h)).__name__ == "FrameTooLarge" and end is None
        return f"{label(h)}, then {label(end)}", ok, ""

    async def _grpc(self, rng, data: bytes):
        from dgr.protocol import wire
        from dgr.transport.client import ShardClient

        ep = rng.choice(self.endpoints)
        c = ShardClient(ep, security=self.security)
        try:
            st = c.stream()
            try:
                reply = await st.step(data, WAIT)
            finally:
                await st.close()
        finally:
            await c.close()
        return wire.decode(reply).header

    async def grpc_garbage(self, rng):
        from dgr import errors

        body = rng.randbytes(rng.randint(0, 2048))
        h = await self._grpc(rng, body)
        return label(h), isinstance(error_of(h), errors.FrameError), f"{len(body)} bytes"

    async def grpc_bad_header(self, rng):
        from dgr import errors

        h = await self._grpc(rng, self.bad_header(rng))
        e = error_of(h)
        return label(h), e is not None and type(e) is not errors.DgrError, str(e)

    async def relay_stranger(self, rng):
        from dgr import errors
        from dgr.protocol import wire
        from dgr.transport.dataplane import LEN

        dialed = []
        srv = await asyncio.start_server(lambda r, w: (dialed.append(1), w.close()),
                                         STRANGER, 0)
        port = srv.sockets[0].getsockname()[1]
        st = self.stages[0]
        try:
            c = await Raw.open(st.data_endpoint, SOURCES["relay_stranger"])
            try:
                rid = uuid.uuid4().hex
                hello = await c.hello(rid)
                loop = rng.random() < 0.5
                hop = [wire.Hop(endpoint=f"{STRANGER}:{port}")]
                kw = dict(loop=hop, steps=4) if loop else {}
                f = self.forward(st, f"stranger-{self.n}", self.prompts[2][:5], reply_to=rid,
                                 relay=hop, **kw)
                await c.send(LEN.pack(len(f)) + f)
                h = await c.frame()
            finally:
                c.close()
            await asyncio.sleep(0.5)  # a connection attempt would have reached us by now
        finally:
            srv.close()
            await srv.wait_closed()
        ok = hello == "Hello echoed" and type(error_of(h)) is errors.RelayRefused \
            and not dialed
        return f"{label(h)}; {len(dialed)} connection(s) to the stranger", ok, str(error_of(h))

    async def flood(self, rng):
        from dgr import errors

        async with self.flood_lock:
            st, ep = self._data(rng)
            cap = self.opts.flood_cap
            n = cap + FLOOD_EXTRA
            conns = await asyncio.gather(*(Raw.open(ep, SOURCES["flood"]) for _ in range(n)),
                                         return_exceptions=True)
            answers = collections.Counter()
            try:
                async def first(c):
                    if isinstance(c, BaseException):
                        return f"connect failed: {type(c).__name__}"
                    try:
                        h = await c.frame(2.0)  # a refusal comes at once
                    except TimeoutError:
                        return await c.hello()  # silent: served
                    except ConnectionError:
                        return "reset"
                    return label(h)

                for a in await asyncio.gather(*(first(c) for c in conns)):
                    answers[a] += 1
            finally:
                for c in conns:
                    if not isinstance(c, BaseException):
                        c.close()
        refused = answers[f"ErrorReply {errors.ResourceExhausted.__name__}"]
        served = answers["Hello echoed"]
        ok = served + refused == n and refused >= FLOOD_EXTRA and served <= cap
        self.tally.faults["flood"].setdefault("refused", 0)
        self.tally.faults["flood"]["refused"] += refused
        return f"{served} served, {refused} refused (ResourceExhausted)", ok, str(dict(answers))


async def _auth_refused(c: Raw) -> tuple[str, bool]:
    """Send a ``Hello`` on ``c``: the answer must be one ``Unauthenticated`` and the close."""
    from dgr import errors

    h = await c.hello()
    end = await c.frame()
    return h, h == f"ErrorReply {errors.Unauthenticated.__name__}" and end is None


async def _refused_with(self, rng, kind: str, auth: bool | bytes):
    """A data connection opened with ``auth`` (``Raw.open``): it must be refused."""
    st, ep = self._data(rng)
    c = await Raw.open(ep, SOURCES[kind], auth=auth)
    try:
        answer, ok = await _auth_refused(c)
    finally:
        c.close()
    return answer, ok, ""


async def auth_missing(self, rng):
    """A data connection without the authentication frame."""
    return await _refused_with(self, rng, "auth_missing", False)


async def auth_wrong(self, rng):
    """A data connection whose first frame is signed with a wrong secret (or an unknown
    name, or is not a token at all)."""
    from dgr.transport.security import AUTH_MAGIC, Credential, sign

    forged = [AUTH_MAGIC + sign(Credential(self.security.credential.name, b"x" * 32),
                                "data").encode(),
              AUTH_MAGIC + sign(Credential("mallory", b"x" * 32), "data").encode(),
              AUTH_MAGIC + rng.randbytes(rng.randint(0, 120))]
    return await _refused_with(self, rng, "auth_wrong", rng.choice(forged))


async def auth_replay(self, rng):
    """A captured authentication frame replayed on a second connection: the first is
    served, the replay refused."""
    st, ep = self._data(rng)
    frame = self.security.auth_frame()
    a = await Raw.open(ep, SOURCES["auth_replay"], auth=frame)
    try:
        first = await a.hello()
    finally:
        a.close()
    b = await Raw.open(ep, SOURCES["auth_replay"], auth=frame)
    try:
        answer, ok = await _auth_refused(b)
    finally:
        b.close()
    return f"{first}; replay: {answer}", first == "Hello echoed" and ok, ""


async def grpc_unauthenticated(self, rng):
    """gRPC calls without the credential or with a wrong one: ``Unauthenticated``; health
    stays public."""
    from dgr import errors
    from dgr.transport.client import ShardClient
    from dgr.transport.security import Credential, Security

    ep = rng.choice(self.endpoints)
    wrong = rng.choice([None, Credential(self.security.credential.name, b"x" * 32)])
    c = ShardClient(ep, security=Security(wrong, None, self.security.tls))
    try:
        health = await c.health(timeout=WAIT)
        try:
            await c.describe(timeout=WAIT)
            answer = "served"
        except errors.DgrError as e:
            answer = type(e).__name__
    finally:
        await c.close()
    return (f"health {health}; describe {answer}",
            health == "SERVING" and answer == errors.Unauthenticated.__name__, "")


for _f in (auth_missing, auth_wrong, auth_replay, grpc_unauthenticated):
    setattr(BadClients, _f.__name__, _f)
del _f


async def faults(bad: BadClients, opts, t_end: float) -> None:
    rng = random.Random(f"{opts.seed}-faults")
    # drawn from a shuffled deck holding each kind as often as its weight: every kind comes
    # up once in each pass of the deck (sum of the weights faults), whatever the seed
    deck: list[str] = []
    sem = asyncio.Semaphore(FAULTS_AT_ONCE)
    running: set[asyncio.Task] = set()

    async def one(kind, r):
        try:
            await bad.run(kind, r)
        finally:
            sem.release()

    while time.monotonic() < t_end:
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        await sem.acquire()
        if time.monotonic() >= t_end:
            sem.release()
            break
        if not deck:
            deck = [k for k in kinds_of(opts) for _ in range(WEIGHTS[k])]
            rng.shuffle(deck)
        kind = deck.pop()
        t = asyncio.create_task(one(kind, random.Random(rng.random())))
        running.add(t)
        t.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running)


# -- monitoring ---------------------------------------------------------------------------------


class Monitor:
    """RSS of every worker (and this process) every ``every`` s; whether they are alive."""

    def __init__(self, cluster, every: float):
        self.cluster = cluster
        self.every = every
        self.t0 = time.monotonic()
        self.series: list[dict] = []
        self.died: dict[int, int] = {}

    def sample(self) -> dict:
        row = {"t_s": round(time.monotonic() - self.t0, 2),
               "workers_kb": [rss_kb(w.proc.pid) for w in self.cluster.workers],
               "driver_kb": rss_kb(os.getpid())}
        for i, w in enumerate(self.cluster.workers):
            if w.proc.poll() is not None and i not in self.died:
                self.died[i] = w.proc.returncode
        self.series.append(row)
        return row

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.sample()


async def progress(tally: Tally, mon: Monitor, t0: float, every: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every)
        s = tally.sessions
        row = mon.series[-1] if mon.series else {"workers_kb": []}
        mb = "/".join(f"{(k or 0) / 1024:.0f}" for k in row["workers_kb"])
        nf = sum(f["count"] for f in tally.faults.values())
        bad = sum(f["unexpected"] for f in tally.faults.values())
        el = time.monotonic() - t0
        say(f"{el:5.0f} s: sessions {s['completed']} completed, {s['lost']} lost, "
            f"{s['wrong']} wrong, {tally.in_flight} in flight; {tally.tokens} tokens "
            f"({tally.tokens / el:.0f}/s); {nf} faults ({bad} unexpected); worker RSS MB {mb}"
            + (f"; DIED: {mon.died}" if mon.died else ""))


# -- the run ------------------------------------------------------------------------------------


def references(engine, prompts: list[list[int]]) -> list[list[int]]:
    """The whole model's greedy tokens for each prompt, ``MAX_TOKENS`` each."""
    from dgr.core.local import generate_local

    return [[int(t) for t in generate_local(engine, p, max_tokens=MAX_TOKENS,
                                            stop_on_eog=False)[0]] for p in prompts]


def dropped_fates(cluster, ids: list[str]) -> dict:
    """How each worker let go of the dropped drivers' sessions, from its log: the events
    (``expire``, ``evict``, ``release``, ``abort``) of the ids it had opened."""
    out = {}
    want = set(ids)
    for i, w in enumerate(cluster.workers):
        opened, fate = set(), collections.Counter()
        with open(w.log_path, "rb") as f:
            for line in f.read().decode("utf-8", "replace").splitlines():
                parts = line.split()
                for j, tok in enumerate(parts):
                    if tok.startswith("session=") and tok[8:] in want and j > 0:
                        ev = parts[j - 1]
                        if ev == "open":
                            opened.add(tok[8:])
                        elif ev in ("expire", "evict", "release", "abort"):
                            fate[ev] += 1
        out[f"stage{i}"] = {"opened": len(opened), **fate}
    return out


async def soak(opts, cluster, refs, prompts, tally: Tally) -> dict:
    from dgr.driver.route import AsyncRoute

    endpoints = cluster.endpoints
    routes = {}
    for p in PATHS:
        routes[p] = await AsyncRoute(endpoints, **route_options(opts, p)).connect()
        count_recoveries(routes[p], tally)
    try:
        stages = routes["relay"].stages
        warm = random.Random(f"{opts.seed}-warm")
        for p in PATHS:  # one warm-up session per path, before the start values
            await one_session(routes, refs, prompts, tally, warm, p, label="warm-up")
        mon = Monitor(cluster, opts.sample_every)
        mon.sample()
        bad = BadClients(opts, stages, endpoints, prompts, refs, tally)
        t0 = time.monotonic()
        t_end = t0 + opts.duration
        bg = [asyncio.create_task(mon.run()), asyncio.create_task(progress(tally, mon, t0))]
        try:
            await asyncio.gather(
                faults(bad, opts, t_end),
                *(lane(i, opts, routes, refs, prompts, tally, t_end)
                  for i in range(opts.sessions)))
            load_s = time.monotonic() - t0
            # every session let go by now, or by the TTL (dropped drivers'): slots come back
            settle = opts.ttl + min(opts.ttl / 4, 5.0) + 10.0
            deadline = time.monotonic() + settle
            while True:
                infos = await routes["grpc"].describe()
                left = [i.sessions for i in infos]
                if not any(left) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            settled_s = time.monotonic() - t0 - load_s
            final = random.Random(f"{opts.seed}-final")
            for p in PATHS:  # the workers still serve the whole model's tokens
                await one_session(routes, refs, prompts, tally, final, p, label="final")
            infos = await routes["grpc"].describe()
        finally:
            for t in bg:
                t.cancel()
        mon.sample()
    finally:
        for r in routes.values():
            await r.close()
    # the final checks' own sessions were released: count what is still held
    return {"load_s": load_s, "settle_s": settled_s, "sessions_left": left,
            "free_slots_end": [i.free_slots for i in infos],
            "sessions_end": [i.sessions for i in infos],
            "steps_total": [i.steps_total for i in infos],
            "errors_total": [i.errors_total for i in infos],
            "monitor": mon}


def rss_figures(mon: Monitor, cluster, steady_after: float) -> dict:
    """Per worker: RSS at the start of the load, at the end, the growth, the maximum, and
    the *steady* growth: from the first sample at least ``steady_after`` s into the load
    (allocator arenas, connection threads and caches fill in the first seconds) to the end."""
    series = mon.series
    workers = []
    for i, w in enumerate(cluster.workers):
        rows = [(r["t_s"], r["workers_kb"][i]) for r in series if r["workers_kb"][i]]
        vals = [v for _, v in rows]
        later = [v for t, v in rows if t >= steady_after] or vals[-1:]
        workers.append({"endpoint": w.endpoint, "layers": list(w.layers or ()),
                        "pid": w.proc.pid, "start_kb": vals[0] if vals else None,
                        "end_kb": vals[-1] if vals else None,
                        "max_kb": max(vals) if vals else None,
                        "growth_kb": (vals[-1] - vals[0]) if vals else None,
                        "steady_from_s": steady_after,
                        "steady_growth_kb": (vals[-1] - later[0]) if vals else None})
    d = [r["driver_kb"] for r in series if r["driver_kb"]]
    return {"every_s": mon.every, "steady_after_s": steady_after, "workers": workers,
            "driver": {"start_kb": d[0], "end_kb": d[-1], "growth_kb": d[-1] - d[0]} if d
            else {}, "series": series}


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, stages=3, json=True)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    ap.add_argument("--sessions", type=int, default=24, help="concurrent session lanes")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (references)")
    ap.add_argument("--early", type=float, default=0.2,
                    help="fraction of sessions released before max_tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ttl", type=float, default=10.0, help="the workers' session TTL (s)")
    ap.add_argument("--frame-timeout", type=float, default=3.0,
                    help="the workers' --frame-timeout (s)")
    ap.add_argument("--max-connections", type=int, default=256,
                    help="the workers' --max-data-connections")
    ap.add_argument("--flood-cap", type=int, default=16,
                    help="the workers' --max-data-connections-per-address (the flood opens "
                         f"this many + {FLOOD_EXTRA})")
    ap.add_argument("--sample-every", type=float, default=5.0, help="RSS sampling period (s)")
    ap.add_argument("--model", help="GGUF (default: the registry's default model)")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--secure", action="store_true",
                    help="workers with cluster credentials and mutual TLS on both planes "
                         "(a throwaway CA, random secrets); every client presents the "
                         "tenant's credential and certificate, and bad clients also try "
                         f"{', '.join(SECURE_KINDS)} (docs/security.md)")
    opts = ap.parse_args(argv)

    from dgr.artifacts import models
    from dgr.core.engine import Engine
    from dgr.protocol.ranges import ranges_for
    from dgr.worker.process import LocalCluster

    model = opts.model or str(models.path(models.DEFAULT_MODEL))
    rng = random.Random(f"{opts.seed}-prompts")
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(4, MAX_PROMPT))]
               for _ in range(opts.prompts)]
    options = dict(vars(opts))  # before the secure files and the tenant's secret join
    tmp = None
    if opts.secure:
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="dgr-soak-")
        secure_files(opts, tmp.name)
    t_start = time.monotonic()
    whole = Engine(model, **SETTINGS)
    ranges = ranges_for(None, opts.stages, whole.n_layer)
    cluster = LocalCluster(model, [None if r == (0, whole.n_layer) else r for r in ranges],
                           settings=SETTINGS, args=worker_args(opts))
    tally = Tally(opts.early, kinds_of(opts))
    out: dict = {"model": model, "settings": SETTINGS, "options": options,
                 "ranges": [list(r) for r in ranges], "paths": PATHS}
    try:
        for w in cluster.workers:  # they load while the reference computes
            w.start()
        say(f"{len(ranges)} workers loading {model}: " + " ".join(f"[{a},{b})" for a, b in ranges))
        t = time.perf_counter()
        refs = references(whole, prompts)
        del whole
        out["reference_s"] = time.perf_counter() - t
        say(f"reference: {len(prompts)} prompts x {MAX_TOKENS} tokens on the whole model in "
            f"{out['reference_s']:.1f} s")
        for w in cluster.workers:
            w.wait_listening(opts.start_timeout)
        out["workers"] = [{"endpoint": w.endpoint, "command": w.command(), "log": w.log_path}
                          for w in cluster.workers]
        out["startup_s"] = time.monotonic() - t_start
        say(f"route {','.join(cluster.endpoints)} up after {out['startup_s']:.1f} s; "
            f"{opts.sessions} lanes for {opts.duration:g} s")
        res = asyncio.run(soak(opts, cluster, refs, prompts, tally))
        mon = res.pop("monitor")
        out.update(res)
        out["rss"] = rss_figures(mon, cluster, min(30.0, opts.duration / 4))
        died = dict(mon.died)
    finally:
        alive = [w.proc is not None and w.proc.poll() is None for w in cluster.workers]
        codes = cluster.stop()
        if tmp is not None:
            tmp.cleanup()
    for i, a in enumerate(alive):
        if not a and i not in died:
            died[i] = cluster.workers[i].returncode
    out["dropped_sessions"] = {"count": len(tally.dropped),
                               "on_workers": dropped_fates(cluster, tally.dropped)}
    out["sessions"] = dict(tally.sessions)
    out["recovered_errors"] = dict(tally.recovered)
    out["by_path"] = {p: dict(c) for p, c in tally.by_path.items()}
    out["tokens"] = tally.tokens
    out["problems"] = tally.problems
    out["faults"] = {k: {**f, "answers": dict(f["answers"])} for k, f in tally.faults.items()}
    out["bad_client_hold_s_max"] = max(tally.cut_s, default=None)
    out["workers_died"] = {str(k): v for k, v in died.items()}
    out["exit_codes"] = codes
    leaked = sum(out["sessions_left"])
    unexpected = sum(f["unexpected"] for f in tally.faults.values())
    s = tally.sessions
    out["verdict"] = {"lost": s["lost"], "wrong": s["wrong"], "workers_died": len(died),
                      "sessions_leaked": leaked, "unexpected_answers": unexpected}
    ok = not (s["lost"] or s["wrong"] or died or leaked or unexpected)
    out["ok"] = ok
    summary(out)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


def summary(out: dict) -> None:
    s = out["sessions"]
    print(f"soak: {out['load_s']:.0f} s of load on {len(out['ranges'])} stages "
          f"({out['model'].rsplit('/', 1)[-1]}), {out['options']['sessions']} lanes, "
          f"seed {out['options']['seed']}")
    print(f"sessions: {s.get('started', 0)} started, {s.get('completed', 0)} completed "
          f"({s.get('released_early', 0)} released early), lost {s.get('lost', 0)}, "
          f"wrong {s.get('wrong', 0)}; {s.get('recoveries', 0)} recoveries "
          f"{out['recovered_errors'] or ''}; {out['tokens']} tokens checked")
    for p, c in out["by_path"].items():
        print(f"  {p:<11} {c.get('completed', 0):5d} completed  {c.get('lost', 0)} lost  "
              f"{c.get('wrong', 0)} wrong")
    print("faults and bad clients (answer: count):")
    for k, f in out["faults"].items():
        answers = "; ".join(f"{a}: {n}" for a, n in sorted(f["answers"].items()))
        print(f"  {k:<17} {f['count']:4d}  {answers}"
              + (f"  UNEXPECTED {f['unexpected']}" if f["unexpected"] else ""))
    d = out["dropped_sessions"]
    print(f"dropped drivers' sessions: {d['count']}; on the workers: {d['on_workers']}")
    print(f"sessions held after {out['settle_s']:.1f} s of settling: {out['sessions_left']}")
    print(f"RSS (MB) start -> end (growth; steady growth from "
          f"{out['rss']['steady_after_s']:g} s), max:")
    for w in out["rss"]["workers"]:
        print(f"  stage {w['layers']} pid {w['pid']}: {w['start_kb'] / 1024:.1f} -> "
              f"{w['end_kb'] / 1024:.1f} ({w['growth_kb'] / 1024:+.1f}; steady "
              f"{w['steady_growth_kb'] / 1024:+.1f}), max {w['max_kb'] / 1024:.1f}")
    d = out["rss"]["driver"]
    if d:
        print(f"  driver (this process): {d['start_kb'] / 1024:.1f} -> {d['end_kb'] / 1024:.1f} "
              f"({d['growth_kb'] / 1024:+.1f})")
    print(f"workers died: {out['workers_died'] or 'none'}; exit codes {out['exit_codes']}")
    for p in out["problems"][:5]:
        print(f"  problem: {p}")
    v = out["verdict"]
    print(("OK" if out["ok"] else "FAILED") + ": " + ", ".join(f"{k} {n}" for k, n in v.items()))


if __name__ == "__main__":
    sys.exit(main())
