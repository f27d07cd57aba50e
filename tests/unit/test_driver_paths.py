"""The driver's step interface and the recovery policy around it (no workers, no model):
the session picks its path from the route's configuration, a failed step is repaired and
resumed where it failed, a broken decode loop hands over to one step per token, and every
step gets ``max_retries`` repairs."""

from __future__ import annotations

import asyncio
import types

import pytest

from dgr import errors
from dgr.driver.headers import forward_header
from dgr.driver.paths import DecodeLoop, HopByHop, Relay, StepPath
from dgr.driver.session import AsyncRouteSession
from dgr.protocol import wire

STAGE = types.SimpleNamespace(endpoint="a:1", layers=(0, 4), identity="sha256:00")


class FakeRecovery:
    """Records each repair (error class, attempt) and raises the epoch, as a repair does."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    async def recover(self, s, err, attempt=1):
        self.calls.append((type(err).__name__, attempt))
        s.epoch += 1


def route(relay=False, loop=True, max_retries=3):
    return types.SimpleNamespace(stages=[STAGE], clients=[None], relay=relay, loop=loop,
                                 max_retries=max_retries, recovery=FakeRecovery(),
                                 n_ubatch=4)


def frame(tok: int) -> wire.Frame:
    return wire.Frame(header=wire.Result(session="s", epoch=1, first_pos=0, n_tokens=1,
                                         kind="none", tokens=[tok]))


class Steps(StepPath):
    """One step per chunk; the token after a chunk is its last token + 1. The first ``fail``
    steps fail with ``err`` (after nothing reached the history)."""

    def __init__(self, s, fail=0, err=errors.CacheMiss):
        super().__init__(s)
        self.fail, self.err = fail, err
        self.sent: list[list[int]] = []

    async def prefill(self, chunks, want, sampling):
        for toks in chunks:
            self.sent.append(list(toks))
            if self.fail:
                self.fail -= 1
                raise self.err("lost")
            self.s._extend(toks)
            yield frame(toks[-1] + 1)


class Loop(Steps):
    """A decode loop that breaks (``err``) after ``after`` tokens; then ``fallback``."""

    def __init__(self, s, after, err=errors.WorkerUnavailable, fallback_fail=0):
        super().__init__(s)
        self.after, self.loop_err = after, err
        self._fallback = Steps(s, fail=fallback_fail)

    @property
    def fallback(self):
        return self._fallback

    async def decode(self, tok, n, want, sampling, eog, logits):
        for k in range(n):
            if k == self.after:
                raise self.loop_err("loop broke")
            self.s._extend([tok])
            tok += 1
            yield tok


def session(r, path_cls=None, **kw):
    s = AsyncRouteSession(r, "s")
    s.epoch = 1
    if path_cls is not None:
        s.path = path_cls(s, **kw)
    return s


async def collect(agen) -> list[int]:
    return [t async for t in agen]


def test_the_session_picks_its_path_from_the_route():
    assert isinstance(session(route(relay=False)).path, HopByHop)
    s = session(route(relay=False))
    assert s.path is s.hop_by_hop  # the path recovery replays over, in every case
    s = session(route(relay=True, loop=False))
    assert type(s.path) is Relay and s.path.fallback is s.path
    s = session(route(relay=True, loop=True))
    assert type(s.path) is DecodeLoop and type(s.path.fallback) is Relay


def test_a_broken_decode_loop_goes_on_step_by_step_from_its_last_token():
    r = route()
    s = session(r, Loop, after=2)
    toks = asyncio.run(collect(s._decode(10, 5, "token", None, frozenset(), False)))
    assert toks == [11, 12, 13, 14, 15]
    # one repair, as the first attempt of the next step (no backoff); the loop not restarted
    assert r.recovery.calls == [("WorkerUnavailable", 0)]
    assert s.path.fallback.sent == [[12], [13], [14]]  # fed from the loop's last token
    assert s.history == [10, 11, 12, 13, 14] and s.steps == [(i, 1) for i in range(5)]


def test_each_step_gets_max_retries_repairs_then_the_error():
    r = route(max_retries=2)
    s = session(r, Steps, fail=3)
    with pytest.raises(errors.CacheMiss):
        asyncio.run(collect(s._decode(10, 2, "token", None, frozenset(), False)))
    assert r.recovery.calls == [("CacheMiss", 1), ("CacheMiss", 2)]
    # one failure fewer: the step goes through, and the next step has its own budget
    r = route(max_retries=2)
    s = session(r, Steps, fail=2)
    assert asyncio.run(collect(s._decode(10, 2, "token", None, frozenset(), False))) == [11, 12]
    assert r.recovery.calls == [("CacheMiss", 1), ("CacheMiss", 2)]


def test_after_a_broken_loop_the_next_step_has_a_full_budget_of_repairs():
    r = route(max_retries=2)
    s = session(r, Loop, after=0, fallback_fail=2)
    assert asyncio.run(collect(s._decode(10, 1, "token", None, frozenset(), False))) == [11]
    assert r.recovery.calls == [("WorkerUnavailable", 0), ("CacheMiss", 1), ("CacheMiss", 2)]


def test_a_fatal_error_is_not_repaired():
    r = route()
    s = session(r, Steps, fail=1, err=errors.ModelMismatch)
    with pytest.raises(errors.ModelMismatch):
        asyncio.run(collect(s._decode(10, 3, "token", None, frozenset(), False)))
    assert r.recovery.calls == []
    r = route()
    s = session(r, Loop, after=1, err=errors.NoHealthyWorker)  # retryable's one exception
    with pytest.raises(errors.NoHealthyWorker):
        asyncio.run(collect(s._decode(10, 3, "token", None, frozenset(), False)))
    assert r.recovery.calls == []


def test_a_prefill_resumes_at_the_chunk_that_failed():
    r = route()
    s = session(r)

    class FailsOnce(Steps):
        async def prefill(self, chunks, want, sampling):
            async for f in super().prefill(chunks, want, sampling):
                yield f
                if len(self.sent) == 2 and not self.failed:
                    self.failed = True
                    raise errors.StepDeadlineExceeded("slow")

    s.path = FailsOnce(s)
    s.path.failed = False
    assert asyncio.run(s.prefill(list(range(10)))) == 10
    assert r.recovery.calls == [("StepDeadlineExceeded", 1)]
    assert s.path.sent == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # no chunk sent twice
    assert s.steps == [(0, 4), (4, 4), (8, 2)] and s.history == list(range(10))


def test_the_header_asks_for_the_boundary_except_at_the_end():
    sampling = wire.Sampling(temperature=0.5, top_k=4, top_p=0.9, seed=7)
    h = forward_header("s", 3, STAGE, 8, [5, 6], want="token", sampling=sampling,
                       last=False, tokens=False)
    assert (h.want, h.sampling, h.tokens, h.n_tokens, h.first_pos, h.layer, h.model) == \
        ("boundary", None, None, 2, 8, 0, "sha256:00")
    h = forward_header("s", 3, STAGE, 8, [5, 6], want="token", sampling=sampling)
    assert (h.want, h.sampling, h.tokens) == ("token", sampling, [5, 6])
    assert (h.relay, h.reply_to, h.loop, h.steps, h.stop_tokens) == (None, "", None, 0, None)


class RelayRoute(types.SimpleNamespace):
    """A route for ``Relay``: the first stage's link records each sent chunk, and the test
    answers them (``answer``) as the last stage's replies would come back."""

    def __init__(self, deadline: float):
        sent = []
        super().__init__(
            stages=[STAGE], clients=[None], relay=True, loop=False, max_retries=0,
            recovery=FakeRecovery(), n_ubatch=4, route_id="r", speculate="",
            batching=True, relay_steps=0, sent=sent,
            relay_links=types.SimpleNamespace(hops=lambda: None, pending={}),
            deadlines=types.SimpleNamespace(measured_relay=lambda n, s: None))
        self._deadline = deadline
        self._link = types.SimpleNamespace(send=sent.append)

    async def links(self):
        return [self._link]

    def deadline(self, i, n):
        return self._deadline


async def _answer(r: RelayRoute, gaps: list[float]) -> None:
    """Answer the pending chunks in order, ``gaps[k]`` seconds before the k-th reply."""
    await asyncio.sleep(0)
    for (key, fut), gap in zip(list(r.relay_links.pending.items()), gaps):
        await asyncio.sleep(gap)
        if not fut.done():
            fut.set_result(frame(7))


def test_a_relayed_prefill_may_take_longer_than_one_deadline_while_each_chunk_keeps_its_own():
    # the chunks queue on the stages: a long prompt's replies come one after another, and the
    # batch takes far longer than a step's deadline; each reply is due within a deadline of
    # the one before it (a deadline for the whole batch expired a 32k prompt)
    async def run():
        r = RelayRoute(deadline=0.3)
        s = session(r, Relay)
        chunks = [[1, 2, 3, 4]] * 6
        answering = asyncio.ensure_future(_answer(r, [0.12] * 6))  # 0.72 s in all
        got = [f async for f in s.path.prefill(chunks, "token", None)]
        await answering
        return len(got), len(r.sent), len(s.history)

    assert asyncio.run(run()) == (6, 6, 24)


def test_a_relayed_chunk_whose_reply_stalls_past_its_deadline_fails_the_step():
    async def run():
        r = RelayRoute(deadline=0.3)
        s = session(r, Relay)
        answering = asyncio.ensure_future(_answer(r, [0.05, 0.05, 0.6]))
        got = []
        with pytest.raises(errors.StepDeadlineExceeded, match="position 8"):
            async for f in s.path.prefill([[1, 2, 3, 4]] * 3, "token", None):
                got.append(f)
        answering.cancel()
        return len(got), len(s.history), r.relay_links.pending

    assert asyncio.run(run()) == (2, 8, {})
