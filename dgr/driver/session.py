"""One route session (asyncio): its epoch, token history and step composition, the step path
it runs on, and the recovery policy applied around that path."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Sequence

import numpy as np

from dgr import errors
from dgr.driver.headers import wire_sampling
from dgr.driver.media import MediaKey, MediaRef, MediaStep, prompt_keys, uncarried
from dgr.driver.paths import HopByHop, StepPath, path_for
from dgr.driver.recovery import release_quietly, retryable
from dgr.driver.results import Generation, StageStats
from dgr.driver.reuse import ReuseRules
from dgr.driver.text import TextStream
from dgr.protocol import prefix, wire
from dgr.protocol.sampling import SamplingParams

__all__ = ["AsyncRouteSession"]


class AsyncRouteSession(ReuseRules):
    """One route session: its streams, epoch, token history and step composition.

    ``route`` is the ``AsyncRoute`` it runs on. Its steps take the route's path
    (``dgr.driver.paths.path_for``: hop by hop, direct relay, or relay with the decode loop);
    a step that fails with a ``retryable`` error is repaired by the route's recovery policy
    (new epoch, history replayed, the failed stage replaced) and tried again, at most
    ``route.max_retries`` times. Which of its positions a later prompt may keep is
    ``dgr.driver.reuse.ReuseRules``'.
    """

    def __init__(self, route: Any, session_id: str, *, tenant: str | None = None):
        self.route = route
        self.id = session_id
        #: whose prefixes the session adopts and keeps in the stages' stores (``adopt``,
        #: ``close(keep=True)``; a front's API key): one tenant never reuses another's
        self.tenant = tenant
        self.epoch = 0
        #: tokens whose state every stage holds under the current epoch
        self.history: list[int] = []
        #: (first_pos, n_tokens) of each step that built ``history`` (replayed on recovery)
        self.steps: list[tuple[int, int]] = []
        #: (first_pos, n_tokens) of the prompt chunks among them (``prefill``'s, not the
        #: decode steps'): what ``reusable`` may keep for a later prompt
        self.chunks: list[tuple[int, int]] = []
        #: positions at which every stage keeps a snapshot of this session's recurrent state
        #: (a recurrent or hybrid model's route, ``state_snapshots``): the ends of the whole
        #: ``n_ubatch`` chunks prefilled from position 0, the last ones, as the engines keep
        #: them (``Engine.state_snapshots``; a stage that keeps more holds these too)
        self.snapshots: list[int] = []
        #: the media steps among ``steps`` (and ``chunks``), by their first position
        #: (``prefill_media``): ``history`` holds a ``MediaKey`` at each position they
        #: advance (their media's id: a later prompt with the same media there reuses them),
        #: recovery replays their rows
        self.media: dict[int, MediaStep] = {}
        #: logits rows that sampled each token (only with ``logits=True``)
        self.logits: list[np.ndarray] = []
        #: positions the stages' caches hold past ``history`` (drafts a decode loop left
        #: there, rejected): the next step rolls them back (``Forward.rollback``)
        self.rollback = 0
        #: decode-loop trips, drafts sent and drafts accepted (speculative decoding)
        self.trips = self.drafted = self.accepted = 0
        self.recoveries = 0
        self.stats = [StageStats(s.endpoint, s.layers) for s in route.stages]
        self._cleanup: set[asyncio.Task] = set()  # releases on replaced workers
        #: the gRPC path (its step streams): recovery replays over it whatever ``path`` is
        self.hop_by_hop = HopByHop(self)
        #: the path this session's steps take, from the route's configuration
        self.path: StepPath = path_for(self)

    # -- the steps, with recovery around them ---------------------------------------------

    async def _repaired(self, run) -> wire.Frame:
        """``await run()`` (a step, or steps, at the end of ``history``), repaired by
        re-prefill when a stage lost the session (on a replacement worker when the stage
        itself failed), up to ``max_retries`` times; its reply."""
        recovery = self.route.recovery
        err: BaseException | None = None
        for attempt in range(self.route.max_retries + 1):
            try:
                if err is not None:
                    await recovery.recover(self, err, attempt)
                return await run()
            except errors.DgrError as e:
                if not retryable(e):  # bad request, model mismatch, no healthy worker, ...
                    raise
                err = e
        assert err is not None
        raise err

    async def _run_chunks(self, chunks: list[list[int]], want: str,
                          sampling: wire.Sampling | None) -> wire.Frame:
        """Steps at the end of ``history`` (``want``/``sampling`` apply to the last one) on
        this session's path, repaired (``_repaired``: a repair replays the steps done, then
        the rest); the last step's reply."""
        done = 0

        async def run() -> wire.Frame:
            nonlocal done
            async for f in self.path.prefill(chunks[done:], want, sampling):
                done += 1
            return f

        return await self._repaired(run)

    async def _run_media(self, step: MediaStep, want: str, sampling: wire.Sampling | None
                         ) -> wire.Frame:
        """A media step at the end of ``history``, hop by hop over gRPC on any path (the
        direct relay carries token steps), repaired as ``_run_chunks`` repairs a step."""
        return await self._repaired(lambda: self.hop_by_hop.forward(
            [], step.first_pos, want, sampling, media=step))

    async def _decode(self, tok: int, n: int, want: str, sampling: wire.Sampling | None,
                      eog: frozenset, logits: bool) -> AsyncIterator[int]:
        """The ``n`` tokens after ``tok`` (which is fed first) from this session's path,
        repaired as ``_run_chunks`` repairs a step. A path whose decode broke hands over to
        its ``fallback`` (the decode loop to one relayed step per token), its failure
        repaired as the first attempt of the next step; every step gets ``max_retries``
        repairs."""
        recovery = self.route.recovery
        path = self.path
        made = 0
        err: BaseException | None = None
        attempt = 0
        while made < n:
            tokens = None
            try:
                if err is not None:
                    await recovery.recover(self, err, attempt)
                tokens = path.decode(tok, n - made, want, sampling, eog, logits)
                async for tok in tokens:
                    made += 1
                    err, attempt = None, 0
                    yield tok
            except errors.DgrError as e:
                if not retryable(e):
                    raise
                if path.fallback is not path:
                    # ``tok`` (the last token yielded) is not in ``history`` yet: repair the
                    # route, then feed it step by step
                    path = path.fallback
                else:
                    attempt += 1
                    if attempt > self.route.max_retries:
                        raise
                err = e
            finally:
                if tokens is not None:
                    await tokens.aclose()

    def take_rollback(self, pos: int) -> int:
        """``Forward.rollback`` of the next step, at ``pos`` (the end of ``history``): what
        the caches hold past it; the step drops it."""
        r, self.rollback = self.rollback, 0
        return r if pos == len(self.history) else 0

    def trip(self, drafted: int, made: int) -> None:
        """A decode-loop trip verified ``drafted`` drafts and made ``made`` tokens."""
        self.trips += 1
        if drafted:
            self.drafted += drafted
            self.accepted += made - 1

    def _extend(self, toks: list[int]) -> None:
        first = len(self.history)
        self.steps.append((first, len(toks)))
        self.history.extend(toks)
        keep = self.route_snapshots()
        if keep and len(toks) == self.route.n_ubatch and first == self.aligned() - len(toks):
            # a whole chunk that continues the run of whole chunks from 0: every stage took
            # a snapshot at its end, and dropped its oldest past ``keep``
            self.snapshots = (self.snapshots + [first + len(toks)])[-keep:]

    def _take(self, f: wire.Frame, logits: bool) -> int:
        if logits:
            self.logits.append(np.array(f.array[-1]))
        return int(f.header.tokens[-1])

    # -- public --------------------------------------------------------------------------

    async def reset(self) -> None:
        """Start over: the next step begins a new epoch at position 0."""
        self.epoch += 1
        self.history, self.steps, self.chunks, self.logits = [], [], [], []
        self.snapshots, self.media = [], {}
        self.rollback = 0

    async def prefill(self, tokens: Sequence[int], *, sample: bool = True,
                      sampling: SamplingParams | None = None, logits: bool = False,
                      align: bool = False) -> int | None:
        """Append ``tokens`` in chunks of at most ``n_ubatch``; returns the next token sampled
        from the last row (None with ``sample=False``). With ``align`` the chunks end where a
        fresh prefill's do (at multiples of ``n_ubatch`` from position 0), so only the first
        may be shorter than a fresh prefill's."""
        toks = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        if not toks:
            raise errors.InvalidArgument("prefill needs at least one token")
        if self.epoch == 0:
            self.epoch = 1
        ub = self.route.n_ubatch
        want = ("token+logits" if logits else "token") if sample else (
            "logits" if logits else "boundary")
        ws = wire_sampling(sampling, start=len(self.history) + len(toks))
        start = len(self.history)
        # ``align``: the first chunk ends where a fresh prefill's chunk does (the rest of a
        # prompt that keeps rows of a chunk cut short), the others are a fresh prefill's
        head = -start % ub if align else 0
        edges = sorted({0, *range(head, len(toks), ub)})
        chunks = [toks[a:b] for a, b in zip(edges, edges[1:] + [len(toks)])]
        f = await self._run_chunks(chunks, want, ws)
        self.chunks.extend((start + a, len(c)) for a, c in zip(edges, chunks))
        return self._take(f, logits) if sample else None

    async def prefill_media(self, step: MediaStep, *, sample: bool = False,
                            sampling: SamplingParams | None = None, logits: bool = False
                            ) -> int | None:
        """Append a media step (``dgr.driver.media.MediaStep``: an image or audio chunk that
        ``dgr.Media`` encoded, its positions from the end of ``history``) on every stage:
        the first stage takes its rows instead of token embeddings. Returns the token sampled
        from its last row with ``sample`` (a prompt that ends with the media), else None.

        Raises
        ------
        dgr.errors.InvalidPosition
            The step does not start at the end of ``history`` (``len(history)``).
        dgr.errors.InvalidArgument
            A route of a recurrent or hybrid model (its state snapshots are per whole chunk
            of token ids: not carried yet), with a stage older than wire schema 6, or a
            split whose later stages own deepstack layers (``dgr.driver.media.uncarried``).
        """
        if step.first_pos != len(self.history):
            raise errors.InvalidPosition(
                f"the media step starts at position {step.first_pos}; this session continues "
                f"at {len(self.history)}")
        if self.recurrent():
            raise errors.InvalidArgument("media steps on a route of a recurrent or hybrid "
                                         "model are not carried yet")
        why = uncarried(self.route.stages, step.rows.shape[1])
        if why:
            raise errors.InvalidArgument(why)
        old = [st.endpoint for st in self.route.stages if st.wire_schema_version < 6]
        if old:  # it would refuse the rows, or compute them with text positions, causally
            raise errors.InvalidArgument(
                f"stage(s) {', '.join(old)} speak a wire schema older than 6: no media steps")
        if self.epoch == 0:
            self.epoch = 1
        want = ("token+logits" if logits else "token") if sample else (
            "logits" if logits else "boundary")
        f = await self._run_media(step, want,
                                  wire_sampling(sampling, start=step.first_pos + step.span))
        self._extend_media(step)
        return self._take(f, logits) if sample else None

    def _extend_media(self, step: MediaStep) -> None:
        first = len(self.history)
        self.steps.append((first, step.span))
        self.chunks.append((first, step.span))  # a prompt step: one step in any prefill
        self.history.extend(MediaKey(step.id, j) for j in range(step.span))
        self.media[first] = step

    async def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """Every row's final hidden state, after the model's output norm, of ``tokens``
        prefilled from position 0 (a new epoch) in chunks of ``n_ubatch``: float32 ``[n,
        n_embd]`` (pool with ``dgr.protocol.embeddings.pool``). Each chunk is a step of its
        own that runs alone on every stage (``Forward.want`` ``"embedding"``), repaired as
        any step.

        Raises
        ------
        dgr.errors.InvalidArgument
            No tokens, or a last stage that returns no embeddings.
        dgr.errors.FrameError
            The last stage's reply is not one embedding row per token.
        """
        toks = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        if not toks:
            raise errors.InvalidArgument("an embedding needs at least one token")
        if self.history or self.rollback or self.epoch == 0:
            await self.reset()
        ub, rows = self.route.n_ubatch, []
        for a in range(0, len(toks), ub):
            chunk, start = toks[a:a + ub], len(self.history)
            f = await self._run_chunks([chunk], "embedding", None)
            self.chunks.append((start, len(chunk)))
            if f.header.kind != "embedding" or f.array is None or \
                    f.array.shape[0] != len(chunk):
                raise errors.FrameError(
                    f"the last stage answered an embedding step of {len(chunk)} rows with "
                    f"{f.header.kind} {None if f.array is None else list(f.array.shape)}")
            rows.append(np.array(f.array, dtype=np.float32))
        return np.concatenate(rows)

    async def fork(self, n: int) -> list[AsyncRouteSession]:
        """``n`` new sessions that continue from this one: every stage copies its caches into
        a slot of each (``Worker.fork``, bit for bit, the last stage's token record too), and
        each starts with this one's history, so ``generate(prompt, reuse=...)`` on it
        prefills only the rest, as on a kept session. A session with nothing prefilled gives
        ``n`` new sessions. This one is unchanged.

        Raises
        ------
        dgr.errors.InvalidArgument
            ``n`` below 1, drafts of a decode loop still in the caches (fork after a prefill),
            or an engine that copies no slot.
        dgr.errors.DgrError
            A stage refused or failed (no slot, ...): the sessions opened are released.
        """
        if n < 1:
            raise errors.InvalidArgument(f"a fork makes at least one session, got {n}")
        r = self.route
        forks = [r.session(tenant=self.tenant) for _ in range(n)]
        if not self.history:
            return forks
        if self.rollback:
            raise errors.InvalidArgument(
                "the caches hold rejected drafts past this session's history: fork after a "
                "prefill, not in the middle of a decode loop")
        ids = [f.id for f in forks]
        got = await asyncio.gather(*(c.fork(self.id, self.epoch, ids, 1) for c in r.clients),
                                   return_exceptions=True)
        bad = next((g for g in got if isinstance(g, BaseException)), None)
        if bad is None and any(g != len(self.history) for g in got):
            bad = errors.CacheMiss(f"a fork continues at positions {got}, not at "
                                   f"{len(self.history)}: a stage lost this session")
        if bad is not None:
            await asyncio.gather(*(release_quietly(c, i, r.probe_timeout)
                                   for c in r.clients for i in ids))
            raise bad
        for f in forks:
            f.epoch = 1
            f.history, f.steps, f.chunks = list(self.history), list(self.steps), list(self.chunks)
            f.media = dict(self.media)
            f.snapshots = list(self.snapshots)  # each stage copied them with the slot
        return forks

    def _keep(self, n: int) -> None:
        """Cut ``history`` to its first ``n`` tokens (``n`` at most ``reusable``'s); the next
        step drops the rest from every stage's cache (``Forward.rollback``). A step cut short
        keeps its first rows (recovery replays them as one step)."""
        self.rollback += len(self.history) - n
        self.history = self.history[:n]
        self.steps = [(a, min(c, n - a)) for a, c in self.steps if a < n]
        self.snapshots = [p for p in self.snapshots if p <= n]
        self.chunks = [(a, min(c, n - a)) for a, c in self.chunks if a < n]
        self.media = {a: m for a, m in self.media.items() if a + m.span <= n}
        self.logits = []

    async def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                       sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                       stop_on_eog: bool = True, logits: bool = False,
                       add_special: bool = True, parse_special: bool = True,
                       reuse: int = 0) -> AsyncIterator[int]:
        """Prefill ``prompt`` (from position 0, new epoch) and yield sampled tokens.

        ``reuse``: keep the session's first ``reuse`` positions instead (a multiple of
        ``n_ubatch``, within ``aligned()``, shorter than ``prompt``, and ``history``'s
        tokens there equal to ``prompt``'s): every stage drops the rest of its cache and
        prefills from there, in the chunks a fresh prefill makes, so the bits are a fresh
        prefill's. Anything else is ``InvalidArgument``.

        Stops after ``max_tokens``, at an end-of-generation token (not yielded) or once the
        text contains one of ``stop`` (the token completing it is yielded). ``logits=True``
        (parity mode) also keeps, in ``self.logits``, the last-row logits that sampled each
        token, computed exactly as a whole-model ``Engine.forward(..., logits="last")``.

        Raises
        ------
        dgr.errors.DgrError
            A failure recovery could not repair (``WorkerDraining``, ``StaleEpoch``,
            ``ModelMismatch``, ``WorkerUnavailable`` after ``connect_timeout``, ...).
        """
        r = self.route
        if isinstance(prompt, str):
            prompt = await r.tokenize(prompt, add_special, parse_special)
        prompt = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not prompt:
            raise errors.InvalidArgument("the prompt has no tokens")
        if max_tokens < 1:
            return
        await self._start_at(prompt, reuse)
        tok = await self.prefill(prompt[reuse:], sampling=sampling, logits=logits,
                                 align=True)
        gen = self._from(tok, max_tokens, sampling, stop, stop_on_eog, logits)
        try:
            async for t in gen:
                yield t
        finally:  # a caller that stops early ends the decode now (its streams, its loop)
            await gen.aclose()

    async def _start_at(self, prompt: Sequence, reuse: int) -> None:
        """Keep this session's first ``reuse`` positions for ``prompt`` (its keys), checked
        against ``reusable``, or start a new epoch from position 0 (``reuse`` 0)."""
        if not reuse:
            await self.reset()
            return
        ub, most = self.route.n_ubatch, self.reusable(prompt)
        if self.recurrent() and reuse not in self.snapshots[:self.snapshots.index(most) + 1
                                                             if most else 0]:
            raise errors.InvalidArgument(
                f"reuse={reuse}: on this recurrent route a session goes back only to a state "
                f"snapshot every stage keeps, and this prompt may keep "
                f"{[p for p in self.snapshots if p <= most]} positions")
        inside = any(a < reuse < a + m.span for a, m in self.media.items())
        if reuse != most and (reuse % ub or reuse > most or inside):
            raise errors.InvalidArgument(
                f"reuse={reuse}: this session can keep {most} positions for this prompt "
                f"(or fewer whole chunks of {ub} tokens, none inside a media step) with a "
                "fresh prefill's bits")
        self._keep(reuse)

    async def generate_media(self, chunks: Sequence, *, max_tokens: int = 64,
                             sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                             stop_on_eog: bool = True, logits: bool = False, reuse: int = 0
                             ) -> AsyncIterator[int]:
        """``generate`` of a prompt with media: ``chunks`` (``AsyncRoute.encode_media``'s,
        from position 0: text chunks' token ids and ``MediaStep``s) prefilled from position 0
        (a new epoch), each text chunk in a fresh prefill's chunks, each media step as one
        step (``prefill_media``), then the tokens sampled from the last row, as
        ``generate``'s.

        ``reuse``: keep the session's first ``reuse`` positions instead, as ``generate``'s
        (``reusable`` of the prompt's ``dgr.driver.media.prompt_keys``: the same media at the
        same positions is reused as equal token ids are), and prefill the chunks from there;
        a chunk before ``reuse`` may be a ``MediaRef`` (not encoded: its rows are kept)."""
        if not chunks:
            raise errors.InvalidArgument("the prompt has no chunks")
        if max_tokens < 1:
            return
        await self._start_at(prompt_keys(chunks) if reuse else [], reuse)
        tok, pos = None, 0
        for k, c in enumerate(chunks):
            last = k == len(chunks) - 1
            media = isinstance(c, (MediaStep, MediaRef))
            end = pos + (c.span if media else len(c))
            if end <= reuse and not last:  # kept
                pos = end
                continue
            if isinstance(c, MediaRef):
                raise errors.InvalidArgument(
                    f"the media chunk at position {pos} is not encoded, and this session does "
                    f"not keep it (it keeps {reuse} positions)")
            if isinstance(c, MediaStep):
                tok = await self.prefill_media(c, sample=last, sampling=sampling,
                                               logits=logits)
            elif end > pos:
                tok = await self.prefill(c[max(0, reuse - pos):], sample=last,
                                         sampling=sampling, logits=logits, align=True)
            elif last:
                raise errors.InvalidArgument("the prompt's last chunk has no tokens")
            pos = end
        gen = self._from(tok, max_tokens, sampling, stop, stop_on_eog, logits)
        try:
            async for t in gen:
                yield t
        finally:
            await gen.aclose()

    async def _from(self, tok: int, max_tokens: int, sampling: SamplingParams | None,
                    stop: Sequence[str], stop_on_eog: bool, logits: bool
                    ) -> AsyncIterator[int]:
        """``tok`` (sampled from a prompt's last row) and the tokens after it, as
        ``generate`` yields them (its stop rules)."""
        r = self.route
        self.stop_reason = "length"
        want = "token+logits" if logits else "token"
        ws = wire_sampling(sampling, start=len(self.history))
        eog = r.eog_tokens if stop_on_eog else frozenset()
        stops = [s for s in stop if s]
        text = TextStream(await r.pieces(), stops) if stops else None
        out: list[int] = []
        tokens = None  # the tokens after the prefill's, made on demand
        try:
            while True:
                if tok in eog:
                    self.stop_reason = "eos"
                    return
                out.append(tok)
                yield tok
                if text is not None:
                    text.push(tok)
                    if text.stopped:
                        self.stop_reason = "stop"
                        return
                if len(out) == max_tokens:
                    return
                if tokens is None:
                    tokens = self._decode(tok, max_tokens - len(out), want, ws, eog, logits)
                tok = await anext(tokens)
        finally:
            if tokens is not None:
                await tokens.aclose()

    async def complete(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                       sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                       stop_on_eog: bool = True, logits: bool = False,
                       add_special: bool = True, parse_special: bool = True) -> Generation:
        """Run ``generate`` to the end and return tokens, text and timings."""
        r = self.route
        if isinstance(prompt, str):
            prompt = await r.tokenize(prompt, add_special, parse_special)
        n_prompt = len(prompt)
        t0 = time.perf_counter()
        t_first = None
        toks: list[int] = []
        times: list[float] = []
        rec0 = self.recoveries
        spec0 = (self.trips, self.drafted, self.accepted)
        async for t in self.generate(prompt, max_tokens=max_tokens, sampling=sampling,
                                     stop=stop, stop_on_eog=stop_on_eog, logits=logits):
            times.append(time.perf_counter())
            if t_first is None:
                t_first = times[0]
            toks.append(t)
        t1 = time.perf_counter()
        text = ""
        if toks:  # llama-server's text: the tokens' pieces, cut at the first stop string
            ts = TextStream(await r.pieces(), stop)
            for t in toks:
                ts.push(t)
            ts.finish()
            text = ts.text
        return Generation(tokens=toks, text=text, stop_reason=self.stop_reason,
                          prompt_tokens=n_prompt, time_to_first_token_s=(t_first or t1) - t0,
                          decode_s=t1 - (t_first or t1), recoveries=self.recoveries - rec0,
                          logits=list(self.logits) if logits else None,
                          trips=self.trips - spec0[0], drafted=self.drafted - spec0[1],
                          accepted=self.accepted - spec0[2], token_times=times)

    def prefix_keys(self, tokens: Sequence[int], n: int | None = None,
                    rows: int = 0) -> list[bytes]:
        """The keys that name ``tokens``' first ``n`` whole chunks (all by default), then
        ``rows`` positions one each, in the stages' prefix stores, for this session's tenant
        (``dgr.protocol.prefix.chain``)."""
        r = self.route
        return prefix.chain(tokens, r.n_ubatch, r.prefix_salt(self.tenant), n, rows)

    async def adopt(self, prompt: Sequence[int]) -> int:
        """Take up, on every stage, the kept caches of an ended session of this tenant whose
        tokens began as ``prompt`` does (the stages' prefix stores, ``close(keep=True)``), in
        one round trip: how many of ``prompt``'s positions this session now holds, for
        ``generate(prompt, reuse=...)``; 0 when a stage has none (or fails), and then the
        next step starts a new epoch from position 0, which drops whatever a stage took up.

        What is kept and reused follows ``reusable``'s rule, so the bits are a fresh
        prefill's: whole ``n_ubatch`` chunks from position 0 and, past the prompt's own whole
        chunks, the rows a kept session computed in partial chunks (and one per step) where
        every stage measured them exact, leaving the prompt's rest at least ``least`` rows. A
        session that holds anything, or a route whose stages keep nothing
        (``AsyncRoute.prefix_store``), reuses nothing."""
        r = self.route
        if self.history or self.rollback or not r.prefix_store:
            return 0
        ub, n = r.n_ubatch, len(prompt)
        full = n - n % ub
        whole = (n - 1) // ub
        rows, single, least = self._row_rule()
        tail = max(0, n - least - full) if rows and n % ub else 0
        if self._any_rows():  # any row of the prompt but its last, one key each
            whole, tail = 0, n - 1
        if not whole and not tail:
            return 0
        keys = self.prefix_keys(prompt, whole, tail)
        self.epoch += 1
        got = await asyncio.gather(*(c.reuse(self.id, self.epoch, keys, ub)
                                     for c in r.clients), return_exceptions=True)
        pos = [g if isinstance(g, int) else 0 for g in got]
        m = min(pos)
        if not m or any(p != m for p in pos):
            if any(pos):  # what a stage took up is dropped by the next step's new epoch
                await self.reset()
            return 0
        # a kept partial chunk cut to one row would be replayed (recovery) as a one-row step,
        # which may take another kernel: keep the whole chunks only, roll the row back
        kept = full if m == full + 1 and not single else m
        self.history = [int(t) for t in prompt[:kept]]
        aligned = kept - kept % ub
        self.steps = [(a, ub) for a in range(0, aligned, ub)]
        if kept > aligned:
            self.steps.append((aligned, kept - aligned))
        self.chunks = list(self.steps)
        self.rollback = m - kept
        return kept

    async def release(self) -> None:
        """Free this session's slot on every stage now (ignores stages that are gone)."""
        await asyncio.gather(*(c.release(self.id) for c in self.route.clients),
                             return_exceptions=True)

    async def close(self, keep: bool = False) -> None:
        """Release the session and close its streams. With ``keep``, every stage whose
        prefix store takes it keeps the caches of its whole ``n_ubatch`` chunks prefilled
        from position 0 (``aligned``), and of the run of rows after them a later prompt may
        keep (``reusable``'s rule), for a later session of this tenant (``adopt``); a stage
        that does not releases it."""
        await self.hop_by_hop.close()
        r = self.route
        keep = keep and not self.media  # a media step's rows have no token ids to name them
        if keep and r.prefix_store and self._any_rows():
            n = self._computed()
            if n:
                await asyncio.gather(*(c.keep(self.id, self.prefix_keys(self.history[:n], 0, n),
                                              r.n_ubatch, 0) for c in r.clients),
                                     return_exceptions=True)
                return
        elif keep and r.prefix_store:
            aligned = self.aligned()
            rows, single, least = self._row_rule()
            tail = self._rows_end(aligned, single, least) - aligned if rows else 0
            if self._chunk_rule():  # every prompt row, however its chunks were cut
                end = self._chunks_end()
                aligned, tail = end - end % r.n_ubatch, end % r.n_ubatch
            if aligned or tail:
                whole = aligned // r.n_ubatch
                keys = self.prefix_keys(self.history, whole, tail)
                await asyncio.gather(*(c.keep(self.id, keys, r.n_ubatch, whole)
                                       for c in r.clients), return_exceptions=True)
                return
        await self.release()
