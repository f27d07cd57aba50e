"""The front's prompt cache (dgr.serve.prefix.PrefixPool): what a kept session may reuse
(whole chunks it prefilled from 0, the common prefix, one prompt token left), one tenant never
takes another's, least recently kept first out, idle ones expire."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dgr.serve.prefix import PrefixPool, session_bytes


def _session(history, steps, ub=4, chunks=None, rows_exact=(False,), single=None, chunk=None,
             rollback_window=-1, state_snapshots=0, snapshots=(), **route):
    """An ``AsyncRouteSession``'s reuse state: ``chunks`` are the prompt chunks among
    ``steps`` (default: every step of more than one token), each stage's
    ``prefix_rows_exact`` from ``rows_exact``, ``prefix_single_rows_exact`` from ``single``
    and ``prefix_chunk_rows_exact`` from ``chunk`` (default: False everywhere), each stage's
    ``rollback_window`` and ``state_snapshots``, the session's ``snapshots``; ``route``: the
    route's ``speculate`` and ``max_draft``."""
    from dgr.driver.session import AsyncRouteSession

    n = len(rows_exact)
    stages = [SimpleNamespace(prefix_rows_exact=r, prefix_single_rows_exact=o,
                              prefix_chunk_rows_exact=c, rollback_window=rollback_window,
                              state_snapshots=state_snapshots)
              for r, o, c in zip(rows_exact, single or [False] * n, chunk or [False] * n)]
    s = SimpleNamespace(history=list(history), steps=list(steps), rollback=0, logits=[],
                        media={},
                        snapshots=list(snapshots),
                        chunks=list(chunks if chunks is not None
                                    else [st for st in steps if st[1] > 1]),
                        route=SimpleNamespace(n_ubatch=ub, stages=stages, **route))
    for name in ("aligned", "reuses", "reusable", "_keep", "_row_rule", "_rows_end", "_any_rows",
                 "_chunk_rule", "_chunks_end", "_prompt_rows", "_computed", "recurrent",
                 "route_snapshots", "_extend"):
        setattr(s, name, getattr(AsyncRouteSession, name).__get__(s))
    return s


def test_a_route_whose_stages_roll_nothing_back_and_keep_no_snapshot_reuses_nothing():
    """A recurrent or hybrid model's stage (``rollback_window`` 0) cannot be cut back to a
    shorter prefix but to a state snapshot: with none kept (``state_snapshots`` 0, or a worker
    older than the field) nothing is reusable, even rows every stage computes alike, and the
    pool closes such a session at once instead of holding its slots."""
    from dgr.serve.prefix import PrefixPool

    steps = [(0, 4), (4, 4), (8, 2), (10, 1)]
    assert _session(range(11), steps).reusable(list(range(20))) == 8
    s = _session(range(11), steps, rollback_window=0, rows_exact=(True,), single=[True],
                 chunk=[True])
    assert not s.reuses() and s.reusable(list(range(20))) == 0
    pool = PrefixPool(2)
    assert pool.put(None, s) == [s] and len(pool) == 0
    assert pool.take(None, list(range(20))) is None and pool.misses == 1


def test_a_recurrent_route_reuses_only_a_snapshot_every_stage_keeps():
    """With state snapshots (each stage keeps its state at the ends of the last few whole
    chunks prefilled from 0) a recurrent route's session mirrors the stages' list as its steps
    go: a whole chunk continuing the run from 0 adds one, the oldest goes past the fewest any
    stage keeps, a partial chunk or a decode step ends the run, and a reuse keeps only those
    up to it. A later prompt reuses the largest snapshot within the common prefix, never rows
    past it (a recurrent state after a partial chunk or decode steps is not a fresh prefill's),
    and the pool keeps such a session."""
    s = _session([], [], rollback_window=0, state_snapshots=2, rows_exact=(True, True),
                 single=[True, True])
    s.route.stages[1].state_snapshots = 3
    s.history, s.steps = [], []
    assert s.reuses() and s.route_snapshots() == 2
    for first in range(0, 12, 4):
        s._extend(list(range(first, first + 4)))
    assert s.snapshots == [8, 12]                  # the last two of 4, 8, 12
    s._extend([12, 13])                            # a partial chunk: the run ends
    s._extend([14, 15, 16, 17])                    # a whole chunk after it takes none
    s._extend([18])
    assert s.snapshots == [8, 12] and s.aligned() == 12
    assert s.reusable(list(range(30))) == 12        # not the rows 12..18 every stage computes alike
    assert s.reusable(list(range(11)) + [99]) == 8
    assert s.reusable(list(range(7)) + [99]) == 0   # 4 was dropped
    s._keep(8)
    assert s.snapshots == [8] and s.aligned() == 8
    pool = PrefixPool(2)
    assert pool.put(None, s) == [] and pool.take(None, list(range(9)) + [99]) == (s, 8)
    other = _session([], [], rollback_window=-1, state_snapshots=0)
    other._extend([0, 1, 2, 3])
    assert other.snapshots == [] and other.route_snapshots() == 0  # no recurrent stage


def test_what_a_kept_session_may_reuse():
    # prefilled 10 tokens in chunks 4, 4, 2, then decoded 3
    s = _session(range(13), [(0, 4), (4, 4), (8, 2), (10, 1), (11, 1), (12, 1)])
    assert s.aligned() == 8
    assert s.reusable(list(range(20))) == 8       # the aligned chunks
    assert s.reusable(list(range(7)) + [99]) == 4  # common prefix 7: one chunk
    assert s.reusable(list(range(8))) == 4          # one token left to prefill
    assert s.reusable([5] + list(range(1, 9))) == 0
    odd = _session(range(10), [(0, 3), (3, 4), (7, 3)])          # not a fresh chunking
    assert odd.reusable(list(range(10))) == 0


def test_partial_chunk_rows_are_reused_where_every_stage_computes_them_alike():
    # prefilled 7 tokens as one partial chunk (n_ubatch 8), then decoded 2
    steps = [(0, 7), (7, 1), (8, 1)]
    s = _session(range(9), steps, ub=8, rows_exact=(True, True))
    assert s.reusable(list(range(5)) + [99, 98]) == 5   # the common prefix, row by row
    assert s.reusable(list(range(6)) + [99]) == 5       # two prompt rows left to prefill
    wide = _session(range(9), steps, ub=16, rows_exact=(True,))
    assert wide.reusable(list(range(9)) + [99, 98]) == 7  # never the decode steps' rows
    assert s.reusable([0, 99, 98, 97]) == 0             # a chunk is never cut to one row
    assert s.reusable(list(range(7)) + [50]) == 0       # 8 tokens: one whole chunk, fresh
    # a stage that computes partial chunks' rows otherwise: whole chunks only
    assert _session(range(9), steps, ub=8, rows_exact=(True, False)).reusable(
        list(range(5)) + [99, 98]) == 0
    # past the prompt's own whole chunks only, and only after whole chunks from 0
    long = _session(range(14), [(0, 8), (8, 5), (13, 1)], ub=8, rows_exact=(True,))
    assert long.reusable(list(range(12)) + [99]) == 11
    assert long.reusable(list(range(6)) + [99]) == 0    # a whole chunk's rows: never in
    assert long.reusable(list(range(8)) + [99]) == 8    # a prompt's partial chunk
    # a session that reused rows and prefilled its rest: both chunks serve the next prompt
    again = _session(range(9), [(0, 4), (4, 5)], ub=16, rows_exact=(True,))
    assert again.reusable(list(range(8)) + [99]) == 7
    # the tail kept of a chunk cut short, and the rows after it dropped (Forward.rollback)
    s._keep(5)
    assert s.history == [0, 1, 2, 3, 4] and s.steps == [(0, 5)] and s.chunks == [(0, 5)]
    assert s.rollback == 4


def test_decoded_rows_are_reused_where_every_stage_computes_single_rows_alike():
    # prefilled 7 tokens (n_ubatch 16), then decoded rows 7, 8 and 9; token 10 was sampled
    # last and never forwarded (no stage holds its row)
    steps = [(0, 7), (7, 1), (8, 1), (9, 1)]
    both = dict(ub=16, rows_exact=(True, True))
    s = _session(range(11), steps, single=(True, True), **both)
    assert s.reusable(list(range(11)) + [99]) == 10  # the reply's rows, not the last token's
    assert s.reusable(list(range(9)) + [99]) == 9    # the rest may be one row
    assert s.reusable([0, 99, 98]) == 1              # and a chunk may be cut to one row
    # one stage computes single rows otherwise: the prompt's rows only, a rest of two rows
    for other in (_session(range(11), steps, single=(True, False), **both),
                  # a decode loop whose verify steps may be a whole chunk wide
                  _session(range(11), steps, single=(True, True), speculate="ngram",
                           max_draft=15, **both)):
        assert other.reusable(list(range(11)) + [99]) == 7
        assert other.reusable([0, 99, 98]) == 0
    assert _session(range(11), steps, single=(True, True), speculate="ngram", max_draft=14,
                    **both).reusable(list(range(11)) + [99]) == 10
    # single rows alike but partial chunks not: whole chunks only
    assert _session(range(11), steps, ub=16, rows_exact=(True, False), single=(True, True)
                    ).reusable(list(range(11)) + [99]) == 0
    # past whole chunks only: a decoded row inside the prompt's whole chunks is never kept
    long = _session(range(20), [(0, 16), (16, 1), (17, 1), (18, 1)], single=(True, True),
                    **both)
    assert long.reusable(list(range(19)) + [99]) == 19
    short = _session(range(12), [(0, 7), *[(i, 1) for i in range(7, 11)]],
                     single=(True, True), ub=8, rows_exact=(True, True))
    assert short.reusable(list(range(12)) + [99] * 5) == 0  # rows 0-7 are one whole chunk now


def test_every_shared_row_is_reused_where_every_stage_computes_any_cut_alike():
    # whole chunk, partial chunk and single rows alike on every stage (batch-invariant
    # kernels): a next turn crossing the kept session's last whole chunk keeps every row
    steps = [(0, 4), (4, 3), (7, 1), (8, 1)]  # n_ubatch 4: a whole chunk, a partial, 2 decoded
    every = dict(ub=4, rows_exact=(True, True), single=(True, True))
    s = _session(range(10), steps, chunk=(True, True), **every)
    assert s.reusable(list(range(10)) + [99] * 6) == 9  # every forwarded row (not token 9's)
    assert s.reusable(list(range(6)) + [99]) == 6       # into a chunk, any row
    assert s.reusable(list(range(9))) == 8              # one token left to prefill
    # one stage computes a whole chunk's rows otherwise: the rows past whole chunks' rule
    assert _session(range(10), steps, chunk=(True, False), **every).reusable(
        list(range(10)) + [99] * 6) == 4
    # whole chunks alike but single rows not: the prompt's rows (_chunk_rule), not the
    # decoded ones, and not row 6 (the rest's first chunk would be the one row 7)
    assert _session(range(10), steps, ub=4, rows_exact=(True, True), single=(True, False),
                    chunk=(True, True)).reusable(list(range(10)) + [99] * 6) == 6


def test_prompt_rows_are_reused_where_every_stage_computes_any_chunking_of_a_prompt_alike():
    # a whole chunk's rows and partial chunks' alike on every stage, single rows not (ggml's
    # CPU kernels since patch 0026): a next turn keeps every prompt row it shares, inside
    # whole chunks too, never a decoded row, never leaving a one-row chunk on either side
    steps = [(0, 4), (4, 3), (7, 1), (8, 1)]  # n_ubatch 4: a whole chunk, a partial, 2 decoded
    rule = dict(ub=4, rows_exact=(True, True), chunk=(True, True))
    s = _session(range(10), steps, **rule)
    assert s.reusable(list(range(10)) + [99] * 6) == 6  # 7 would leave [7, 8) one row
    assert s.reusable(list(range(6)) + [99] * 6) == 6   # [6, 8) then whole chunks
    assert s.reusable(list(range(5)) + [99] * 6) == 4   # not the chunk (4, 3) cut to one row
    assert s.reusable(list(range(3)) + [99] * 6) == 2   # into a whole chunk, the rest [2, 4)
    assert s.reusable(list(range(2)) + [99] * 6) == 2
    assert s.reusable([0] + [99] * 6) == 0              # (0, 4) cut to one row: nothing
    assert s.reusable(list(range(6)) + [99]) == 4       # not 6 (a one-row rest) nor 5
    assert s.reusable(list(range(7)) + [99]) == 6       # the rest [6, 8): two rows
    long = _session(range(14), [(0, 8), (8, 5), (13, 1)], ub=8, rows_exact=(True,),
                    chunk=(True,))
    assert long.reusable(list(range(6)) + [99] * 20) == 6   # before: 0 (the whole chunk's)
    assert long.reusable(list(range(13)) + [99] * 20) == 13
    # a prompt's one-row chunk ends the run (its row may take another kernel)
    one = _session(range(10), [(0, 4), (4, 4), (8, 1), (9, 1)], **rule)
    assert one.reusable(list(range(10)) + [99] * 3) == 8
    # a stage that computes a whole chunk's rows otherwise: the old rule (whole chunks here)
    assert _session(range(10), steps, ub=4, rows_exact=(True, True), chunk=(True, False)
                    ).reusable(list(range(10)) + [99] * 6) == 4
    # and one whose partial chunks' rows differ: whole chunks only, whatever it says of chunks
    assert _session(range(10), steps, ub=4, rows_exact=(True, False), chunk=(True, True)
                    ).reusable(list(range(10)) + [99] * 6) == 4


def test_tenants_eviction_and_age():
    p = PrefixPool(2, ttl=10)
    a = _session(range(12), [(0, 4), (4, 4), (8, 4)])
    b = _session(range(12), [(0, 4), (4, 4), (8, 4)])
    assert p.put("alice", a) == [] and p.put("bob", b) == []
    assert p.take("carol", list(range(12))) is None               # another tenant's: no
    got = p.take("alice", list(range(12)))
    assert got == (a, 8) and len(p) == 1 and p.hits == 1 and p.misses == 1
    assert p.take("alice", list(range(12))) is None               # taken: gone
    c = _session(range(4), [(0, 4)])
    d = _session(range(4), [(0, 4)])
    assert p.put(None, c) == [] and p.put(None, d) == [b]       # over size: oldest out
    assert p.evict() is c and p.evictions == 2
    assert p.expired(now=1e18) == [d] and len(p) == 0
    off = PrefixPool(0)
    assert off.put(None, a) == [a] and off.take(None, [1]) is None and off.misses == 0
    with pytest.raises(ValueError):
        PrefixPool(-1)


def test_what_the_kept_sessions_hold():
    """Each position a kept session forwarded fills one KV cell on every stage: the stage's
    KV cache over its ``n_ctx * n_slots`` cells, summed over the stages."""
    s = _session(range(11), [(0, 4), (4, 4), (8, 2), (10, 1)], rows_exact=(False, False))
    t = _session(range(5), [(0, 4)], rows_exact=(False, False))  # token 4 never forwarded
    for x in (s, t):
        for st, kv in zip(x.route.stages, (32 * 1024, 32 * 512)):
            st.settings, st.n_ctx, st.kv_bytes = {"n_ctx": 16, "n_slots": 2}, 16, kv
    assert session_bytes(s) == 11 * (1024 + 512) and session_bytes(t) == 4 * 1536
    p = PrefixPool(2)
    assert p.bytes_held() == 0 and p.snapshot()["bytes"] == 0
    p.put(None, s)
    p.put("k", t)
    assert p.bytes_held() == p.snapshot()["bytes"] == 15 * 1536
    p.take(None, list(range(11)))
    assert p.bytes_held() == 4 * 1536


def test_what_a_kept_recurrent_session_holds():
    """On a hybrid model's route each stage's KV cache holds its recurrent state too: a kept
    session holds the attention cells of its positions (the KV bytes less the states, over the
    cells), its state, and the snapshots of it the stage keeps."""
    s = _session(range(9), [(0, 4), (4, 4), (8, 1)], rows_exact=(False, False),
                 rollback_window=0, state_snapshots=4, snapshots=[4, 8])
    for st, kv, state in zip(s.route.stages, (32 * 1024 + 2 * 1000, 32 * 512), (1000, 0)):
        st.settings, st.n_ctx, st.kv_bytes, st.state_bytes = {"n_ctx": 16, "n_slots": 2}, 16, kv, state
    assert session_bytes(s) == 9 * (1024 + 512) + 1000 * 3
