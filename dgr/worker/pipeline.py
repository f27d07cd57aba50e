"""The stage's step pipeline: one sequence for the gRPC ``Step`` stream and the data plane.

A step goes ``accept`` -> ``lease`` -> ``compute`` -> ``finish``, then its frames go out:

- ``accept`` (as its frame arrives): the checks that mean something at the protocol level (a
  step is a ``Forward``; stage identity -> ``ModelMismatch``; the frame's layer and relay
  fields -> ``RouteError``; a ``want`` this stage cannot serve), draining, the inputs' shape;
- ``lease`` (as it is about to run: the stage loop, ``dgr.worker.scheduler``, takes it into
  a batch): the session table's lease (session, epoch, cache miss, context, free slots:
  ``dgr.worker.sessions``); ``admit`` is both at once;
- ``compute`` / ``compute_batch``: under the engine's lock, the slot releases the table
  deferred, each lease's hold on its slot, the engine's forward of one step or of several
  sessions' steps at once (the engine guards its own inputs: boundary shape, a first stage
  given a boundary, missing token ids, vocabulary, positions) and, on a last stage,
  sampling;
- ``finish``: commit (or abort: the session is dropped), the counters, the busy count;
- ``reply``: the ``Result`` frame.

``dgr.worker.worker.Worker`` feeds it from both planes (they differ in how a frame arrives
and where its reply goes); ``dgr.worker.forwarder`` sends a relayed step on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Container
from typing import Any

import numpy as np

from dgr import errors
from dgr.protocol import wire
from dgr.protocol.describe import COUNTERS
from dgr.protocol.sampling import params_of, sample_rows
from dgr.protocol.settings import CPU, complete, stage_identity
from dgr.worker.config import WorkerConfig
from dgr.worker.grammar import Grammars
from dgr.worker.history import Histories
from dgr.worker.profile import Profile
from dgr.worker.scheduler import StageLoop
from dgr.worker.sessions import SessionTable
from dgr.worker.slots import DeferredReleases, Slots
from dgr.worker.speculation import Speculator, accept
from dgr.worker.step import Step
from dgr.worker.trust import RelayPolicy

__all__ = ["StagePipeline", "ComputeWindow"]

log = logging.getLogger("dgr.worker")


class ComputeWindow:
    """Tokens and compute time of recent steps (throughput over the last ``span`` seconds),
    and exact totals since the worker started (named as ``dgr.protocol.describe.COUNTERS``).

    The totals are monotonic counters: a caller describes the worker before and after the
    steps it timed and divides the deltas (``decode_compute_s_total`` /
    ``decode_steps_total``: the mean compute of exactly those single-token steps), where
    ``decode_ms`` (an EWMA of the last few) covers another window. Compute seconds are the
    engine's forward call (sampling and transport excluded)."""

    def __init__(self, span: float = 10.0):
        self.span = span
        self.items: collections.deque = collections.deque()
        self.decode_ms = 0.0  # EWMA of single-token step compute time
        self.started = time.monotonic()
        self.decode_steps_total = 0  # single-token steps computed
        self.decode_compute_s_total = 0.0  # their compute seconds, summed
        self.tokens_computed_total = 0  # tokens computed, every step
        self.compute_s_total = 0.0  # compute seconds of every step, summed

    def add(self, n: int, seconds: float) -> None:
        now = time.monotonic()
        self.items.append((now, n, seconds))
        self.tokens_computed_total += n
        self.compute_s_total += seconds
        if n == 1:
            self.decode_steps_total += 1
            self.decode_compute_s_total += seconds
            self.decode_ms = seconds * 1e3 if not self.decode_ms else (
                0.8 * self.decode_ms + 0.2 * seconds * 1e3)
        while self.items and now - self.items[0][0] > self.span:
            self.items.popleft()

    def tokens_per_s(self) -> float:
        """Tokens computed per second of wall time over the last ``span`` seconds (load)."""
        now = time.monotonic()
        while self.items and now - self.items[0][0] > self.span:
            self.items.popleft()
        span = min(self.span, max(now - self.started, 1e-3))
        return sum(n for _, n, _ in self.items) / span


def wanted_rows(h: wire.Forward) -> list[int]:
    """The rows of ``h`` the last stage returns (logits) or samples (a token): none for a
    boundary, ``rows`` when given, a step's draft rows (``drafts``: the row before the first
    draft and every draft's), else the last row."""
    if h.want == "boundary":
        return []
    if h.drafts:
        return list(range(h.n_tokens - h.drafts - 1, h.n_tokens))
    if h.rows is None:
        return [h.n_tokens - 1]
    return sorted(set(h.rows))


class StagePipeline:
    """The step sequence of a stage and what it owns: the engine and its facts, the session
    table (under ``lock``), the sessions' slots outside their steps (``slots``:
    ``dgr.worker.slots``), the scheduler (``scheduler``: every step of both planes computes
    through it), the counters, the drain flags.

    ``dgr.worker.worker.Worker`` owns one and feeds it from its planes.

    Parameters
    ----------
    engine : dgr.Engine
        The loaded range (its ``lock`` is held around every compute).
    config : dgr.worker.config.WorkerConfig, optional
        The settings the pipeline reads: sessions' expiry, batching, tenant caps, the prefix
        store, the largest frame.
    relay_policy : dgr.worker.trust.RelayPolicy, optional
        Whom relayed frames may make this worker connect to (None: loopback only).
    burst : callable, optional
        The scheduler's ``burst`` (a context a batch's steps are handed on in).
    """

    def __init__(self, engine, config: WorkerConfig | None = None, *,
                 relay_policy: RelayPolicy | None = None, burst=None):
        c = config if config is not None else WorkerConfig()
        self.engine = engine
        self.max_payload = c.max_message
        info = engine.describe()
        self.info = info
        self.settings = complete(engine.settings)
        #: context tokens per session: ``settings["n_ctx"]`` as set, or the one the engine
        #: chose for 0 (its trained context within its KV budget)
        self.n_ctx = int(info.get("n_ctx") or self.settings["n_ctx"])
        self.model_identity = info["identity"]
        #: the kind of the engine's device (``compute_kind``): part of the stage identity
        self.device_kind = getattr(engine, "compute", CPU)
        self.identity = stage_identity(self.model_identity, self.settings, self.device_kind)
        #: the engine's device and what it holds there (``Engine.compute_facts``), read once
        #: here: reading it again would wait for the engine's lock, held by every compute,
        #: and describe runs on the worker's event loop. None: an engine without devices.
        facts = getattr(engine, "compute_facts", None)
        self.engine_device = facts() if facts is not None else None
        self.layers = tuple(engine.layers)
        self.n_layer = info["n_layer"]
        self.is_first, self.is_last = bool(engine.is_first), bool(engine.is_last)
        self.width = int(engine.n_embd_boundary)
        #: columns of what the engine returns: the boundary, or logits on the last stage
        self.out_width = self.width if not engine.is_last else int(engine.n_vocab)
        #: guards the session table (short sections only: the event loop takes it). The
        #: engine's own lock (``engine.lock``) is held around every compute.
        self.lock = threading.RLock()
        #: slots released by the table, not yet by the engine (cleared before the next compute)
        self.releases = DeferredReleases()
        self._counts = threading.Lock()  # counters bumped by the loop and data threads
        self._tls = threading.local()  # per thread: reused output buffers
        self.table = SessionTable(self.releases, engine.n_slots, self.n_ctx,
                                  ttl=c.ttl, evict_after=c.evict_after, listener=self._event)
        #: the prefix store's size (``SessionTable.keep``): every slot by default; none on an
        #: engine whose slots cannot be copied and cut back at any position (MTP, DeepSeek V4)
        can_keep = not getattr(engine, "mtp", False) and int(
            info.get("rollback_window", -1)) < 0
        self.table.prefix_entries = (0 if not can_keep else engine.n_slots
                                     if c.prefix_entries is None else c.prefix_entries)
        self.table.max_sessions_per_owner = c.max_sessions_per_credential
        #: the endpoints relayed frames may make this worker connect to
        #: (``dgr.worker.trust.RelayPolicy``: loopback only by default)
        self.relay_policy = relay_policy if relay_policy is not None else RelayPolicy(None)
        self.draining = False
        #: the engine's device was lost (``DeviceLost``): the worker drains and reports
        #: NOT_SERVING through ``on_unservable`` (hooks the server adds), so routes and
        #: trackers take the stage out
        self.device_lost = False
        self.on_unservable: list = []
        #: set when a drain stops waiting: admitted steps that have not started computing
        #: are refused from then on (counted in ``not_run``)
        self.stopped = False
        self.not_run = 0
        self.inflight = 0  # admitted and not finished
        #: admitted and not finished, per non-peer credential name (``_busy``)
        self._queued: collections.Counter[str] = collections.Counter()
        #: steps a non-peer credential may have queued when its own ``max_queued`` is unset
        self.max_queued_per_credential: int | None = c.max_queued_per_credential
        self.computing = 0  # computes hold the engine's lock: 0 or 1
        self.steps_total = 0
        self.errors_total = 0
        self.window = ComputeWindow()
        #: wall seconds by part of the stage's work (``dgr.worker.profile``)
        self.profile = Profile()
        self.started = time.monotonic()
        #: hop latency of 1-token steps (ms, arrival to reply ready), for the capability record
        self.hop_ms: collections.deque = collections.deque(maxlen=1024)
        self.last_error, self.last_error_at = "", None
        #: the last stage's speculative decoding (dgr.worker.speculation): its drafters and
        #: per-session state; None on other stages
        self.speculator: Speculator | None = None
        #: the last stage's record of each session's tokens, which the penalties count
        #: (dgr.worker.history); None on other stages
        self.history: Histories | None = Histories() if self.is_last else None
        #: the last stage's constrained sessions (dgr.worker.grammar); None on other stages
        self.grammars: Grammars | None = Grammars(engine) if self.is_last else None
        #: sessions' slots outside their steps: release and keep, adopt, fork, the prefix
        #: store's figures (dgr.worker.slots)
        self.slots = Slots(engine, self.table, self.lock, self.releases, self.history,
                           n_ctx=self.n_ctx, kv_bytes=int(info["kv_bytes"]))
        if self.is_last:
            mtp = None
            if getattr(engine, "mtp", False):
                from dgr.worker.speculation import MtpDrafter
                mtp = MtpDrafter(engine, self._owns, self._drop)
            # a step's rollback never goes past what the caches can drop (DeepSeek V4's
            # compressed state keeps a window of snapshots; -1: no limit)
            window = int(info.get("rollback_window", -1))
            self.speculator = Speculator(self.n_ctx, mtp=mtp,
                                         max_rollback=window if window >= 0 else None)
        #: the stage's scheduler (``dgr.worker.scheduler``): every step of both planes computes
        #: through it
        self.scheduler = StageLoop(self, max_tokens=int(self.settings["n_ubatch"]),
                                   batching=c.batching, burst=burst, ring_groups=c.ring_groups,
                                   profile=self.profile, slot_of=self.slot_of)

    def _owns(self, session: str, epoch: int, slot: int) -> bool:
        """Whether ``slot`` is still ``session``'s, under ``epoch``, with no step running and
        no release pending (the MTP drafter's check before it touches the slot)."""
        with self.lock:
            s = self.table.get(session)
            return (s is not None and s.epoch == epoch and s.slot == slot and not s.busy
                    and slot not in self.releases.pending)

    def _drop(self, session: str) -> None:
        """End ``session`` here (its slot was cleared): its next step is refused."""
        with self.lock:
            self.table.release(session)

    @property
    def drafters(self) -> list[str]:
        """The drafters this stage runs as a route's last stage (``Describe.drafters``)."""
        if self.speculator is None or self.speculator.max_rollback == 0:
            return []  # no stage of a route that cannot roll a rejected draft back drafts
        return ["ngram"] + (["mtp"] if self.speculator.mtp is not None else [])

    def _event(self, event: str, session: str, epoch: int, slot: int, detail: str) -> None:
        if self.speculator is not None:  # every event starts or ends a session's state
            self.speculator.forget(session)
        if self.history is not None:
            self.history.forget(session)
        if self.grammars is not None:
            self.grammars.forget(session)
        log.info("%s session=%s epoch=%d slot=%d%s", event, session, epoch, slot,
                 f" ({detail})" if detail else "")

    def compute_counters(self) -> dict[str, float]:
        """The compute totals since start (``COUNTERS``), read together."""
        w = self.window
        with self._counts:
            return {k: getattr(w, k) for k in COUNTERS}

    def slot_of(self, session: str) -> int | None:
        """The session's slot here (None: it holds none). Read without the table's lock (a
        dict lookup): the scheduler groups ring steps by it, and a stale answer only makes
        a batch less dense."""
        info = self.table.get(session)
        return None if info is None else info.slot

    def expire(self) -> None:
        """End the sessions idle past their expiry (``SessionTable.expire``)."""
        with self.lock:
            self.table.expire()

    def close(self) -> None:
        """After a drain: end every session, stop the scheduler (its queued steps are
        refused), and wait for a compute still running on another thread (a data
        connection's), which cannot be interrupted: the engine must not be torn down under
        it."""
        with self.lock:
            self.table.clear()
        self.scheduler.stop()
        with self.engine.lock:
            pass

    # -- admit -----------------------------------------------------------------------------

    def admit(self, frame: wire.Frame, t_arrive: float, *,
              returns: Container[str] | None = None, credential=None) -> Step:
        """Check a decoded frame and lease its session's slot (``accept`` then ``lease``).

        Raises
        ------
        dgr.errors.DgrError
            WorkerDraining, FrameError (not a step), ModelMismatch, RouteError,
            InvalidArgument, and the session table's refusals.
        """
        step = self.accept(frame, t_arrive, returns=returns, credential=credential)
        try:
            self.lease(step)
        except BaseException:
            self._busy(-1, step.credential)
            raise
        return step

    def accept(self, frame: wire.Frame, t_arrive: float, *,
               returns: Container[str] | None = None, credential=None) -> Step:
        """Check a decoded frame: everything but the session table. The step has no lease
        yet: ``lease`` takes it when the step is about to run (the stage loop does, so a
        session's next step may arrive while its previous one still waits or computes).

        ``returns``: the routes with a return connection on this plane (the data plane's);
        None where relayed frames cannot arrive (a gRPC ``Step`` stream). ``credential``: the
        caller's (``dgr.transport.security.Credential``; None without credentials): a
        non-peer one may have at most its ``max_queued`` (else ``max_queued_per_credential``)
        steps admitted and not finished at once.

        Raises
        ------
        dgr.errors.DgrError
            WorkerDraining, FrameError (not a step), ModelMismatch, RouteError,
            InvalidArgument, InvalidBoundary, MissingTokenIds, ResourceExhausted (the
            credential's queued steps).
        """
        h = frame.header
        if self.draining:
            raise errors.WorkerDraining(
                "this worker is draining (shutting down): the step was not run")
        self._check(h)
        self._fits(h, frame.array)
        if self.grammars is not None and h.sampling is not None and h.sampling.grammar:
            # the grammar engine's view of the vocabulary (0.4-2 s, once) is built here, on
            # the connection's thread, not in a step's compute under the engine's lock
            self.grammars.vocab.tokenizer  # noqa: B018
        if h.reply_to:
            if returns is None:
                raise errors.InvalidArgument("relayed frames (reply_to) travel on the data "
                                             "plane, not on a gRPC Step stream")
            if self.is_last and h.reply_to not in returns:
                raise errors.RouteError(f"relayed frame names route {h.reply_to!r}, which sent "
                                        "this worker no Hello (no return connection)")
        self._busy(1, credential)
        return Step(h, frame.array, None, t_arrive, credential=credential)

    def lease(self, step: Step) -> None:
        """Lease ``step``'s session slot from the session table (``step.lease``).

        Raises
        ------
        dgr.errors.DgrError
            The session table's refusals (StaleEpoch, CacheMiss, ContextFull,
            ResourceExhausted, SessionError, ...).
        """
        h = step.header
        with self.lock:
            step.lease = self.table.acquire(h.session, h.epoch, h.first_pos, wire.span(h),
                                            step.credential, rollback=h.rollback)

    def _check(self, h) -> None:
        """What a frame means for this stage, beyond what the engine checks of its inputs."""
        if type(h) is not wire.Forward:
            raise errors.FrameError(f"a step takes Forward frames, got {type(h).__name__}")
        if h.model != self.identity:
            theirs, _, their_tag = h.model.partition("+")
            if theirs == self.model_identity:
                ours = self.identity.partition("+")[2]
                raise errors.ModelMismatch(
                    f"frame was built for numeric settings and device {their_tag or '(none)'}; "
                    f"this worker runs {ours}")
            raise errors.ModelMismatch(
                f"frame is for model {theirs or '(none)'}; this worker serves "
                f"{self.model_identity} layers [{self.layers[0]}, {self.layers[1]})")
        if h.layer != self.layers[0]:
            raise errors.RouteError(
                f"frame starts at layer {h.layer}; this worker serves layers "
                f"[{self.layers[0]}, {self.layers[1]})")
        if h.reply_to:  # relayed: want/sampling are the last stage's, carried along
            if not self.is_last and not h.relay:
                raise errors.RouteError(
                    f"relayed frame ends its route at layer {self.layers[1]} of {self.n_layer}:"
                    " Forward.relay names no next stage")
            if self.is_last and h.relay:
                raise errors.RouteError(
                    f"this worker runs the last layers; Forward.relay names {len(h.relay)} more "
                    "stage(s)")
            # the connections this frame would make this worker open (dgr.worker.trust)
            policy = self.relay_policy
            if policy is not None:
                if not self.is_last:
                    policy.check(h.relay[0].endpoint, "Forward.relay")
                elif h.loop and h.steps > 1:
                    policy.check(h.loop[0].endpoint, "Forward.loop")
        elif not self.is_last and h.want != "boundary":
            raise errors.InvalidArgument(
                f"want={h.want!r} asks for the last stage's output; this stage ends at layer "
                f"{self.layers[1]} of {self.n_layer} and returns a boundary")

    def _fits(self, h: wire.Forward, array) -> None:
        """Whether the frame's inputs can run on this stage at all, checked before the
        session table gives it a slot: a frame that cannot run must not take a slot or evict
        an idle session for one. The engine checks the same again when it runs (it guards
        its inputs for every caller); this check is admission, and raises the same classes."""
        if h.media and array is None:
            raise errors.InvalidBoundary(f"a {h.media} step carries its rows: the frame has none")
        if self.is_first:
            if array is not None and not h.media:
                raise errors.InvalidBoundary(
                    "this worker is the first stage: it takes token ids, not a boundary")
            return  # a media step's embedding rows: the engine checks their width
        if array is None:
            raise errors.InvalidBoundary(
                f"this stage starts at layer {self.layers[0]}: the frame needs a boundary "
                f"[{h.n_tokens}, {self.width}]")
        if array.shape[1] != self.width:
            raise errors.InvalidBoundary(
                f"boundary width {array.shape[1]} differs from this stage's {self.width}")
        if self.engine.needs_token_ids and h.tokens is None and not h.media:
            raise errors.MissingTokenIds(
                f"layers [{self.layers[0]}, {self.layers[1]}) route by token id: send the "
                "token ids with the boundary")

    def _busy(self, delta: int, credential=None) -> None:
        """Count a step admitted (+1) or finished (-1), in all and for a non-peer
        ``credential``, whose cap a new step must fit under.

        Raises
        ------
        dgr.errors.ResourceExhausted
            ``delta`` is +1 and the credential has its cap of steps queued (nothing counted).
        """
        with self._counts:
            if credential is not None and not credential.peer:
                name = credential.name
                if delta > 0:
                    cap = credential.max_queued or self.max_queued_per_credential
                    if cap is not None and self._queued[name] >= cap:
                        raise errors.ResourceExhausted(
                            f"credential {name!r} has {cap} steps queued on this worker, its "
                            "cap: send more after their replies", retry_after=0.05)
                self._queued[name] += delta
                if not self._queued[name]:
                    del self._queued[name]
            self.inflight += delta

    # -- compute ---------------------------------------------------------------------------

    def compute(self, step: Step) -> Step:
        """Run one admitted ``step`` on the engine (any thread): ``compute_batch`` of one.

        Holds the engine's lock from the deferred releases to the end of the forward, so no
        other thread's compute comes between "the lease still holds its slot" and the
        compute on it.

        Raises
        ------
        dgr.errors.WorkerDraining
            The drain is over (the step was not run).
        dgr.errors.CacheMiss
            The session was released while the step waited for the engine.
        dgr.errors.DgrError
            The engine's typed errors (its inputs, its compute).
        """
        (failure,) = self.compute_batch([step])
        if failure is not None:
            raise failure
        return step

    def compute_batch(self, steps: list[Step], batch_id: int = 0
                      ) -> list[BaseException | None]:
        """Run several accepted steps (of different sessions) as one forward; returns each
        step's failure (None: computed). A step without a lease takes it first (``lease``:
        the session table's refusals fail that step alone). ``compute``'s checks hold for
        each step: one released while it waited gets ``CacheMiss``, the others still run.
        Each step that runs gets ``batch = (batch_id, steps run together)``.

        The engine computes the steps in one ``forward_batch`` when it has one and there are
        several; if that refuses its inputs (a typed error about one step's tokens,
        positions or boundary), each step is run alone, so one bad step fails alone. The
        results are views of this thread's output buffer, valid until its next compute.
        """
        fails: list[BaseException | None] = [None] * len(steps)
        t_enter = time.perf_counter()
        with self.engine.lock:
            if self.stopped:
                with self._counts:
                    self.not_run += len(steps)
                e = errors.WorkerDraining(
                    "this worker stopped draining (drain timeout): the step was not run")
                return [e] * len(steps)
            for i, s in enumerate(steps):  # the session table's lease, now that it runs
                if s.lease is None:
                    try:
                        self.lease(s)
                    except Exception as e:  # noqa: BLE001 - this step's refusal
                        fails[i] = e
            with self.lock:
                releases = self.releases.take()
                holds = [f is None and self.table.holds(s.lease) for s, f in zip(steps, fails)]
            for slot in releases:
                self.engine.release(slot)
            run = []
            for i, (s, held) in enumerate(zip(steps, holds)):
                if held:
                    run.append(i)
                elif fails[i] is None:
                    fails[i] = errors.CacheMiss(
                        f"session {s.lease.session!r} epoch {s.lease.epoch} was released "
                        "while this step waited for the engine; the step was not run: "
                        "re-prefill")
            for i in list(run):  # rejected drafts of the step before: roll them back
                h = steps[i].header
                if h.rollback and not steps[i].lease.new:
                    try:
                        self.engine.truncate(steps[i].lease.slot, h.first_pos)
                    except Exception as e:  # noqa: BLE001 - RollbackUnsupported: re-prefill
                        fails[i] = e
                        run.remove(i)
            for i in run:
                steps[i].batch = (batch_id, len(run))
            self.profile.add("lease", time.perf_counter() - t_enter)
            self.computing += 1
            try:
                batched = len(run) > 1 and hasattr(self.engine, "forward_batch")
                if batched:
                    try:
                        self._forward_batch([steps[i] for i in run])
                        return fails
                    except (errors.InvalidArgument, errors.InvalidToken,
                            errors.InvalidPosition, errors.InvalidBoundary,
                            errors.MissingTokenIds, errors.UnknownSlot,
                            errors.ContextFull) as e:
                        log.info("batch of %d refused (%s: %s): running its steps alone",
                                 len(run), type(e).__name__, e)
                    except Exception as e:  # noqa: BLE001 - the engine failed computing
                        for i in run:
                            fails[i] = e
                        return fails
                # each step its own rows of the buffer: all stay valid until handed on
                need = [self.out_rows(steps[i].header) for i in run]
                buf, a = self._thread_out(rows=sum(need)), 0
                for i, k in zip(run, need):
                    try:
                        self._forward(steps[i], buf[a:a + k])
                    except Exception as e:  # noqa: BLE001 - this step's failure
                        fails[i] = e
                    a += k
            finally:
                self.computing -= 1
        return fails

    def _thread_out(self, h: wire.Forward | None = None, rows: int = 0) -> np.ndarray:
        """This thread's reused output buffer, grown to ``rows`` (or what ``h`` needs)."""
        tls = self._tls
        need = max(rows, self.out_rows(h) if h is not None else 0, 1)
        out = getattr(tls, "out", None)
        if out is None or out.shape[0] < need:
            out = tls.out = np.empty((need, self.out_width), np.float32)
        return out

    def _forward_batch(self, steps: list[Step]) -> None:
        """One ``Engine.forward_batch`` over ``steps`` (the engine's lock held), then each
        step's rows, sampled tokens and share of the compute time. An embedding or media step
        is never batched (``InvalidArgument``: the caller runs each step alone)."""
        eng = self.engine
        hs = [s.header for s in steps]
        if any(h.want == "embedding" or h.media for h in hs):
            raise errors.InvalidArgument("an embedding or media step runs alone")
        n = sum(h.n_tokens for h in hs)
        slots = np.concatenate([np.full(h.n_tokens, s.lease.slot, np.int32)
                                for s, h in zip(steps, hs)])
        positions = np.concatenate([
            np.asarray(h.positions, np.int32) if h.positions is not None
            else np.arange(h.first_pos, h.first_pos + h.n_tokens, dtype=np.int32) for h in hs])
        if all(h.tokens is not None for h in hs):
            tokens = np.concatenate([np.asarray(h.tokens, np.int32) for h in hs])
        elif self.is_first or eng.needs_token_ids:
            raise errors.MissingTokenIds("a step of the batch has no token ids")
        else:
            tokens = None
        boundary = None if self.is_first else np.concatenate([s.array for s in steps])
        t0 = time.perf_counter()
        if not self.is_last:
            res = eng.forward_batch(slots, positions, tokens, boundary,
                                    out=self._thread_out(rows=n))
            seconds = time.perf_counter() - t0
            self.profile.add("engine", seconds)
            a = 0
            for s, h in zip(steps, hs):
                s.kind, s.result = "boundary", res[a:a + h.n_tokens]
                s.seconds = seconds * h.n_tokens / n
                a += h.n_tokens
            return
        mask = np.zeros(n, dtype=bool)
        picks: list[list[int]] = []
        a = 0
        for h in hs:
            rows = wanted_rows(h)
            mask[[a + r for r in rows]] = True
            picks.append(rows)
            a += h.n_tokens
        res = eng.forward_batch(slots, positions, tokens, boundary, logits=mask,
                                out=self._thread_out(rows=int(mask.sum())))
        t1 = time.perf_counter()
        seconds = t1 - t0
        self.profile.add("engine", seconds)
        r0 = 0
        for s, h, rows in zip(steps, hs, picks):
            logits = res[r0:r0 + len(rows)]
            r0 += len(rows)
            s.seconds = seconds * h.n_tokens / n
            if h.want.startswith("token"):
                self._sample(s, logits, rows)
            if h.want in ("logits", "token+logits"):
                s.kind, s.result = "logits", logits
        self.profile.add("sample", time.perf_counter() - t1)

    def _forward(self, step: Step, out: np.ndarray | None) -> None:
        """The engine's forward (and sampling on a last stage), the engine's lock held."""
        eng, h, lease = self.engine, step.header, step.lease
        n = h.n_tokens
        # the engine uses token ids where its range needs them (and checks them then)
        tokens = None if h.tokens is None else np.asarray(h.tokens, dtype=np.int32)
        positions = (np.asarray(h.positions, dtype=np.int32) if h.positions is not None
                     else h.first_pos)
        kw: dict[str, Any] = {} if out is None else {"out": out}
        if h.media:  # an encoded media chunk's rows, its positions (all sections), causality
            media_pos = (np.asarray(h.sections, dtype=np.int32).reshape(wire.MROPE_SECTIONS, n)
                         if h.sections is not None else np.asarray(h.positions, dtype=np.int32)
                         if h.positions is not None
                         else np.arange(h.first_pos, h.first_pos + n, dtype=np.int32))

            def run(**more):
                return eng.forward_media(lease.slot, media_pos, step.array, causal=h.causal,
                                         **more, **kw)
        else:
            def run(**more):
                return eng.forward(lease.slot, positions, tokens, boundary=step.array, **more,
                                   **kw)
        t0 = time.perf_counter()
        if not self.is_last:
            step.result = run()
            step.seconds = time.perf_counter() - t0
            self.profile.add("engine", step.seconds)
            step.kind = "boundary"
            return
        want = h.want
        if want == "embedding" and h.media:
            raise errors.InvalidArgument("an embedding step takes token ids or a text boundary")
        if want == "embedding":  # every row's final normed hidden state, not logits
            step.kind, step.result = "embedding", eng.embed(lease.slot, positions, tokens,
                                                            boundary=step.array)
            step.seconds = time.perf_counter() - t0
            self.profile.add("engine", step.seconds)
            return
        rows = wanted_rows(h)
        mask: Any
        if rows == [n - 1]:
            mask = "last"
        else:  # (none, for a boundary: the last stage has none to return)
            mask = np.zeros(n, dtype=bool)
            mask[rows] = True
        logits = run(logits=mask)
        t1 = time.perf_counter()
        step.seconds = t1 - t0
        self.profile.add("engine", step.seconds)
        if want.startswith("token"):
            self._sample(step, logits, rows)
        if want in ("logits", "token+logits"):
            step.kind, step.result = "logits", logits
        self.profile.add("sample", time.perf_counter() - t1)

    def _sample(self, step: Step, logits: np.ndarray, rows: list[int]) -> None:
        """A token from each wanted row; with drafts (``Forward.drafts``), the verified
        ones: the accepted drafts and the token after them (``speculation.accept``). With
        penalties, each row counts the session's tokens before its own (``history``)."""
        h = step.header
        pos = [(h.positions[r] if h.positions is not None else h.first_pos + r) + 1
               for r in rows]
        p = params_of(h.sampling)
        windows = (self.history.windows(h, rows, p.penalty_last_n)
                   if p is not None and p.penalized else None)
        # a constrained session's rows, masked by its grammar (dgr.worker.grammar)
        logits = self.grammars.mask(h, logits, rows, self.history)
        sampled = sample_rows(logits, pos, p, windows)
        if h.drafts:
            step.tokens, step.accepted = accept(h.tokens[h.n_tokens - h.drafts:], sampled,
                                                h.stop_tokens)
        else:
            step.tokens = sampled

    def out_rows(self, h: wire.Forward) -> int:
        """Rows of what the engine returns for ``h`` (a reused output buffer's need)."""
        if not self.is_last:
            return h.n_tokens
        return max(len(wanted_rows(h)), 1)

    # -- finish ----------------------------------------------------------------------------

    def finish(self, step: Step, failure: BaseException | None = None) -> None:
        """After ``compute`` returned (``failure`` None) or raised: commit the step or drop
        its session (its cache is suspect), count it, and end its busy count."""
        lease = step.lease
        if lease is not None:  # a step refused its lease holds nothing in the table
            with self.lock:
                if failure is None:
                    self.table.commit(lease)
                else:
                    self.table.abort(lease, f"{type(failure).__name__}: {failure}")
        if failure is None and self.history is not None:  # the session's tokens so far
            h = step.header
            self.history.commit(h, h.n_tokens - h.drafts + step.accepted if h.drafts
                                else h.n_tokens)
        if failure is None and self.speculator is not None:  # the session's tokens, drafts
            self.speculator.observe(step.header, step.tokens, step.accepted, step.t_arrive)
        if failure is None:
            with self._counts:
                self.steps_total += 1
                self.window.add(step.header.n_tokens, step.seconds)
                if step.header.n_tokens == 1:
                    self.hop_ms.append((time.perf_counter() - step.t_arrive) * 1e3)
        self._busy(-1, step.credential)

    # -- frames ----------------------------------------------------------------------------

    def result_of(self, step: Step) -> tuple[wire.Result, np.ndarray | None, str, bool]:
        """What the ``Result`` frame of a computed step holds: ``(header, array, codec,
        compress)`` (a boundary goes back in the codec and compression it came in)."""
        h = step.header
        if step.kind == "boundary":
            r = wire.Result(session=h.session, epoch=h.epoch, first_pos=h.first_pos,
                            n_tokens=h.n_tokens, kind="boundary", layer=self.layers[1])
            codec = h.codec if step.array is not None else "raw"
            compress = h.compression == "zstd"
        else:
            r = wire.Result(session=h.session, epoch=h.epoch, first_pos=h.first_pos,
                            n_tokens=h.n_tokens, kind=step.kind, tokens=step.tokens,
                            drafted=h.drafts)
            codec, compress = "raw", False
        res = None if step.result is None else np.ascontiguousarray(step.result)
        return r, res, codec, compress

    def reply(self, step: Step, buf: bytearray | None = None):
        """The ``Result`` frame of a computed step: bytes, or encoded into ``buf`` (returned)."""
        r, res, codec, compress = self.result_of(step)
        if buf is None:
            return wire.encode(r, res, codec=codec, compress=compress)
        wire.encode_into(r, res, buf, codec=codec, compress=compress)
        return buf

    def error(self, exc: BaseException, session: str = "", epoch: int = 0) -> bytes:
        """The ``ErrorReply`` frame of a refused or failed step (counted, logged)."""
        with self._counts:
            self.errors_total += 1
        self.last_error, self.last_error_at = f"{type(exc).__name__}: {exc}", time.monotonic()
        if isinstance(exc, errors.DeviceLost) and not self.device_lost:
            self.device_lost = self.draining = True
            log.error("the compute device was lost (%s): draining, health NOT_SERVING", exc)
            for hook in self.on_unservable:
                hook()
        if isinstance(exc, (errors.SessionError, errors.ModelMismatch, errors.RouteError)):
            log.info("refused session=%s epoch=%d: %s: %s", session or "-", epoch,
                     type(exc).__name__, exc)
        elif not isinstance(exc, errors.DgrError):
            log.exception("step failed", exc_info=exc)
        return wire.encode(wire.ErrorReply.from_exception(exc, session=session, epoch=epoch))
