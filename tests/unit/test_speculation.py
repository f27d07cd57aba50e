"""The last stage's speculation (dgr.worker.speculation) and the session table's rollback."""

from __future__ import annotations

import random

import pytest

from dgr import errors
from dgr.protocol import wire
from dgr.worker.sessions import SessionTable
from dgr.worker.speculation import DraftPolicy, NgramDrafter, Rate, Speculator, accept


class _Slots:
    def __init__(self):
        self.released: list[int] = []

    def release(self, slot: int) -> None:
        self.released.append(slot)


def _fwd(pos: int, toks: list[int], *, drafts: int = 0, steps: int = 0, epoch: int = 1,
         speculate: str = "ngram", max_draft: int = 8, session: str = "s") -> wire.Forward:
    return wire.Forward(model="m", session=session, epoch=epoch, first_pos=pos,
                        n_tokens=len(toks), layer=0, tokens=toks, want="token", drafts=drafts,
                        steps=steps, speculate=speculate, max_draft=max_draft,
                        loop=[wire.Hop(endpoint="a:1")] if steps > 1 else None,
                        reply_to="r" if steps > 1 else "")


# -- accept ---------------------------------------------------------------------------


def test_accept_takes_the_longest_matching_prefix_and_the_token_after_it():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == ([5, 6, 9], 2)
    assert accept([5, 6, 7], [5, 6, 7, 8]) == ([5, 6, 7, 8], 3)
    assert accept([5, 6, 7], [4, 6, 7, 8]) == ([4], 0)
    assert accept([], [3]) == ([3], 0)


def test_accept_cuts_after_a_stop_token():
    # an accepted draft that is a stop token ends the emitted tokens there
    assert accept([5, 2, 7], [5, 2, 7, 8], stop_tokens=[2]) == ([5, 2], 3)
    assert accept([5, 6], [5, 2, 9], stop_tokens=[2]) == ([5, 2], 1)


def test_accept_equals_plain_decoding_for_any_drafts():
    """Whatever the drafts, the emitted tokens are a prefix of what plain decoding makes
    from the same rows, and at least one token comes out."""
    rng = random.Random(7)
    for _ in range(500):
        plain = [rng.randrange(4) for _ in range(6)]
        k = rng.randrange(6)
        drafts = [plain[i] if rng.random() < 0.7 else rng.randrange(4) for i in range(k)]
        # the row of draft i samples plain[i] only while every draft before it matched
        emitted, a = accept(drafts, plain[:k + 1])
        assert emitted == plain[:a + 1] and 1 <= len(emitted) <= k + 1
        assert drafts[:a] == plain[:a]


# -- n-gram drafter -------------------------------------------------------------------


def test_ngram_drafts_what_followed_the_latest_occurrence():
    d = NgramDrafter(2, 4)
    idx, h = d.new_state(), [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2]
    d.extend(idx, h, 0)
    assert d.draft(idx, h, 3, 4) == [9, 1, 2, 3]  # (1, 2, 3) last seen before 9
    assert d.draft(idx, h, 3, 2) == [9, 1]
    assert d.draft(idx, h, 7, 4) == []  # (2, 7) never occurred
    assert d.draft(idx, h, 3, 0) == []


def test_ngram_index_follows_truncation_exactly():
    """Truncating and re-extending the history leaves the index it would have had if the
    dropped tokens never came (checked against an index built from scratch)."""
    rng = random.Random(3)
    d = NgramDrafter(1, 3)
    for _ in range(200):
        h = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        idx = d.new_state()
        d.extend(idx, h, 0)
        keep = rng.randrange(len(h) + 1)
        d.truncate(idx, h, keep)
        del h[keep:]
        more = [rng.randrange(5) for _ in range(rng.randrange(10))]
        at = len(h)
        h.extend(more)
        d.extend(idx, h, at)
        fresh = d.new_state()
        d.extend(fresh, h, 0)
        assert idx == fresh


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


# -- policy ---------------------------------------------------------------------------


def test_policy_drafts_more_when_drafts_are_accepted_and_none_when_they_are_not():
    p = DraftPolicy(beta_prior=0.1)
    good, bad = Rate(), Rate()
    for _ in range(20):
        p.update(good, 8, 8)
        p.update(bad, 8, 0)
    assert p.choose(good, 8) == 8
    assert p.choose(bad, 8) == 0
    # a session that stopped drafting tries again once the decay pulls it back to the prior
    for _ in range(400):
        p.update(bad, 0, 0)
    assert p.choose(bad, 8) > 0
    assert p.choose(good, 0) == 0


def test_policy_fits_the_cost_of_a_longer_trip():
    p = DraftPolicy(beta_prior=0.1)
    for k in range(9):  # each draft adds half a plain trip: T(k) = 10 ms * (1 + 0.5 k)
        for _ in range(3):
            p.trip(k, 0.010 * (1 + 0.5 * k))
    assert p.beta == pytest.approx(0.5)
    st = Rate()
    for _ in range(20):
        p.update(st, 4, 2)  # the first two drafts are always accepted, the third never
    assert p.rate(st, 0) > 0.9 and p.rate(st, 1) > 0.9 and p.rate(st, 2) < 0.2
    assert p.choose(st, 8) == 2  # exactly the run that is accepted
    half = Rate()
    for i in range(40):
        p.update(half, 1, i % 2)  # one draft, accepted every other trip
    # E(1) / T(1) = 1.5 / 1.5: no gain at beta 0.5; over a WAN a draft costs almost nothing
    assert p.choose(half, 8) == 0
    assert DraftPolicy(beta_prior=0.01).choose(half, 8) >= 1


# -- speculator -----------------------------------------------------------------------


def test_speculator_keeps_the_history_of_accepted_tokens_and_drafts_from_it():
    sp = Speculator(n_ctx=64)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    sp.observe(_fwd(0, prompt), [3], 0, 1.0)
    st = sp.state("s")
    assert st.history == prompt
    # the loop step after the prompt: token 3 at position 10, drafts from the history
    h = _fwd(0, prompt)
    # (4, 1, 2, 3) last came before 4, 1, 2, 3; with no measurements yet the prior (half of
    # the drafts accepted, a draft costing a tenth of a trip) says draft two of them
    assert sp.draft(h, 0, 3, left=8) == [4, 1]
    assert st.source is sp.rates[4]  # the 4-gram matched: its rate is scored
    # a trip [3, 4, 1, 9] of which two drafts were accepted: 9 is dropped
    trip = _fwd(10, [3, 4, 1, 9], drafts=3, steps=8)
    sp.observe(trip, [4, 1, 2], 2, 2.0)
    assert st.history == prompt + [3, 4, 1]
    assert (sp.stats.trips, sp.stats.drafted, sp.stats.accepted, sp.stats.emitted) == (1, 3, 2, 3)
    # the next step rolls back to position 13
    sp.observe(_fwd(13, [2, 3], drafts=1, steps=5), [3, 4], 1, 3.0)
    assert st.history == prompt + [3, 4, 1, 2, 3]


def test_speculator_drafts_nothing_without_the_token_ids_or_past_the_budget():
    sp = Speculator(n_ctx=12)
    sp.observe(_fwd(0, [1, 2, 1, 2, 1]), [2], 0, 1.0)
    h = _fwd(0, [1, 2, 1, 2, 1])
    assert sp.draft(h, 0, 2, left=1) == []  # the loop makes one more token: no room
    assert len(sp.draft(h, 0, 2, left=30)) <= 12 - 5 - 1  # none past the context
    assert sp.draft(_fwd(0, [1], speculate=""), 0, 2, left=30) == []  # not speculating
    # a step without token ids leaves a gap: no drafts for the rest of the epoch
    gap = wire.Forward(model="m", session="s", epoch=1, first_pos=5, n_tokens=1, layer=0,
                       width=4, want="token")
    sp.observe(gap, [1], 0, 2.0)
    assert sp.draft(h, 0, 2, left=30) == []
    sp.forget("s")
    assert sp.state("s") is None and len(sp) == 0
    # a session first seen mid-epoch has nothing to draft from
    sp.observe(_fwd(7, [1, 2]), [1], 0, 1.0)
    assert sp.state("s") is None
    # nor does the stage keep anything of a session that does not speculate
    sp.observe(_fwd(0, [1, 2, 3], speculate=""), [1], 0, 1.0)
    assert sp.state("s") is None and len(sp) == 0


# -- the session table's rollback -----------------------------------------------------


def test_the_table_admits_a_rollback_only_to_where_the_cache_continues():
    t = SessionTable(_Slots(), n_slots=2, n_ctx=64)
    lease = t.acquire("s", 1, 0, 10)
    t.commit(lease)
    lease = t.acquire("s", 1, 10, 4)  # a trip with three drafts: the cache ends at 14
    t.commit(lease)
    with pytest.raises(errors.CacheMiss, match="after rolling back 1"):
        t.acquire("s", 1, 12, 1, rollback=1)  # 12 + 1 != 14
    with pytest.raises(errors.CacheMiss):
        t.acquire("s", 1, 12, 1)  # a rollback must be stated
    lease = t.acquire("s", 1, 12, 3, rollback=2)
    assert lease.first_pos == 12
    t.commit(lease)
    assert t.get("s").next_pos == 15


def test_rollback_unsupported_is_a_cache_miss_the_driver_repairs():
    e = errors.from_code(errors.RollbackUnsupported.code, "x")
    assert isinstance(e, errors.RollbackUnsupported) and isinstance(e, errors.CacheMiss)


def test_a_trip_is_timed_against_the_drafts_each_stage_computed_in_it():
    """The time from one loop step's arrival at the last stage to the next covers the first
    step's compute here and the second's on the other stages: its k is their mean."""
    sp = Speculator(n_ctx=64)
    sp.observe(_fwd(0, [1, 2, 3, 1, 2, 3]), [1], 0, 0.0)
    loop3 = [wire.Hop(endpoint=f"a:{i}") for i in range(3)]

    def step(pos, toks, drafts):
        return wire.Forward(model="m", session="s", epoch=1, first_pos=pos, n_tokens=len(toks),
                            layer=0, tokens=toks, want="token", drafts=drafts, steps=9,
                            speculate="ngram", max_draft=8, loop=loop3, reply_to="r")

    sp.observe(step(6, [1], 0), [2], 0, 1.0)  # no trip timed yet: the first loop step
    sp.observe(step(7, [2, 3, 1, 2], 3), [3, 1, 2, 9], 3, 1.5)
    sp.observe(step(11, [9, 1], 1), [5], 0, 1.8)
    assert list(sp.policy._trips) == [(pytest.approx((0 + 2 * 3) / 3), 0.5),
                                      (pytest.approx((3 + 2 * 1) / 3), pytest.approx(0.3))]


class _FakeMtpEngine:
    """Records the MTP drafter's engine calls; drafts ``token + 1, token + 2, ...``."""

    def __init__(self, refuse: bool = False):
        import threading

        self.lock = threading.RLock()
        self.calls: list[tuple] = []
        self.refuse = refuse

    def truncate(self, slot, pos):
        self.calls.append(("truncate", slot, pos))
        if self.refuse:
            raise errors.RollbackUnsupported("no")

    def mtp_draft(self, slot, token, k):
        self.calls.append(("draft", slot, token, k))
        return [token + 1 + i for i in range(k)]


def test_mtp_drafts_from_the_accepted_end_of_the_slot():
    """The NextN block drafts from the trunk row of the last position kept: the slot's
    rejected drafts are dropped before the draft, and only while the slot is the session's."""
    from dgr.worker.speculation import FixedDraftPolicy, MtpDrafter

    eng, dropped, owner = _FakeMtpEngine(), [], {"ok": True}
    mtp = MtpDrafter(eng, lambda s, e, slot: owner["ok"], dropped.append)
    sp = Speculator(n_ctx=64, mtp=mtp, policy=FixedDraftPolicy())
    sp.observe(_fwd(0, [1, 2, 3, 4], speculate="mtp"), [5], 0, 0.0)
    # a trip [5, 6, 7, 8] at 4 whose first draft was accepted: the token after it goes at 6
    trip = _fwd(4, [5, 6, 7, 8], drafts=3, steps=9, speculate="mtp", max_draft=4)
    sp.observe(trip, [6, 9], 1, 1.0)
    assert sp.draft(trip, 2, 9, left=7) == [10, 11, 12, 13]
    assert eng.calls == [("truncate", 2, 6), ("draft", 2, 9, 4)]
    owner["ok"] = False  # released meanwhile: the slot is not touched
    assert sp.draft(trip, 2, 9, left=7) == [] and len(eng.calls) == 2
    refusing = MtpDrafter(_FakeMtpEngine(refuse=True), lambda *a: True, dropped.append)
    assert refusing.draft("s", 1, 2, 6, 9, 4) == [] and dropped == ["s"]
