"""The front's prompt cache (dgr.serve.prefix.PrefixPool): what a kept session may reuse
(whole chunks it prefilled from 0, the common prefix, one prompt token left), one tenant never
takes another's, least recently kept first out, idle ones expire."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dgr.serve.prefix import PrefixPool


def _session(history, steps, ub=4):
    s = SimpleNamespace(history=list(history), steps=list(steps),
                        route=SimpleNamespace(n_ubatch=ub))
    # AsyncRouteSession.aligned: whole chunks from 0
    from dgr.driver.session import AsyncRouteSession

    s.aligned = lambda: AsyncRouteSession.aligned(s)
    return s


def test_what_a_kept_session_may_reuse():
    # prefilled 10 tokens in chunks 4, 4, 2, then decoded 3
    s = _session(range(13), [(0, 4), (4, 4), (8, 2), (10, 1), (11, 1), (12, 1)])
    assert s.aligned() == 8
    assert PrefixPool.reusable(s, list(range(20))) == 8       # the aligned chunks
    assert PrefixPool.reusable(s, list(range(7)) + [99]) == 4  # common prefix 7: one chunk
    assert PrefixPool.reusable(s, list(range(8))) == 4          # one token left to prefill
    assert PrefixPool.reusable(s, [5] + list(range(1, 9))) == 0
    odd = _session(range(10), [(0, 3), (3, 4), (7, 3)])          # not a fresh chunking
    assert PrefixPool.reusable(odd, list(range(10))) == 0


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
