"""The stage's prefix store (``SessionTable.keep`` / ``adopt``) against a fake engine and
clock, and the keys that name a prompt's first chunks (``dgr.protocol.prefix``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dgr import errors
from dgr.protocol import prefix
from dgr.worker.sessions import SessionTable

from test_session import Clock, FakeEngine  # noqa: E402  (the session table's fakes)

CHUNK = 4


def make(n_slots=3, entries=3):
    eng, clock, events = FakeEngine(), Clock(), []
    table = SessionTable(eng, n_slots=n_slots, n_ctx=100, ttl=60.0, evict_after=5.0,
                         clock=clock, listener=lambda *a: events.append(a),
                         prefix_entries=entries)
    return table, eng, clock, events


def who(name, peer=False):
    return SimpleNamespace(name=name, peer=peer, max_sessions=None)


def keys(*names):
    return [n.encode() for n in names]


def ran(table, session, n, epoch=1, first=0, caller=None):
    table.commit(table.acquire(session, epoch, first, n, caller))


def test_a_kept_session_is_adopted_at_its_longest_match_on_its_own_slot():
    table, eng, clock, events = make(n_slots=1)
    ran(table, "a", 10)
    assert table.keep("a", keys("k0", "k1"), CHUNK)
    assert "a" not in table and len(table.entries) == 1
    assert table.free_slots == 1 and table.prefix_positions() == 8
    assert events[-1] == ("keep", "a", 1, 0, "8 positions")
    clock.t += 1
    entry, info, copy = table.adopt("b", 3, keys("k0", "k1", "k2"), CHUNK)
    # no free slot: the entry's slot became the session's (the entry is gone)
    assert not copy and info.slot == entry.slot == 0 and info.next_pos == 8
    assert info.epoch == 3 and not table.entries and table.free_slots == 0
    assert (table.prefix_hits, table.prefix_misses) == (1, 0)
    # the session continues where the kept positions end
    ran(table, "b", 2, epoch=3, first=8)
    assert table.get("b").next_pos == 10


def test_with_a_free_slot_the_entry_is_copied_and_stays_for_others():
    table, eng, *_ = make(n_slots=3)
    ran(table, "a", 12)
    assert table.keep("a", keys("k0", "k1", "k2"), CHUNK)
    entry, info, copy = table.adopt("b", 1, keys("k0", "x1"), CHUNK)
    assert copy and info.slot != entry.slot and info.next_pos == CHUNK
    assert eng.released[-1] == info.slot  # the copy's slot is cleared before the copy
    assert len(table.entries) == 1  # still there: a shared system prompt serves many
    entry2, info2, copy2 = table.adopt("c", 1, keys("k0", "k1", "k2", "k3"), CHUNK)
    assert entry2 is entry and copy2 and info2.next_pos == 12


def test_a_miss_opens_nothing_and_is_counted():
    table, *_ = make()
    ran(table, "a", 8)
    assert table.keep("a", keys("k0", "k1"), CHUNK)
    assert table.adopt("b", 1, keys("other"), CHUNK) is None
    assert table.adopt("b", 1, keys("k0"), CHUNK + 1) is None  # other chunking: other rows
    assert "b" not in table and (table.prefix_hits, table.prefix_misses) == (0, 2)


def test_one_tenant_never_adopts_anothers_entry():
    table, *_ = make()
    ran(table, "a", 8, caller=who("alice"))
    assert table.keep("a", keys("k0", "k1"), CHUNK, who("alice"))
    assert table.adopt("b", 1, keys("k0", "k1"), CHUNK, who("bob")) is None
    assert table.adopt("c", 1, keys("k0", "k1"), CHUNK) is None  # nor no credential
    got = table.adopt("d", 1, keys("k0", "k1"), CHUNK, who("alice"))
    assert got is not None and got[1].owner == "alice"
    # and another's session is not kept (nor released) by bob
    ran(table, "e", 8, caller=who("alice"))
    assert not table.keep("e", keys("k0"), CHUNK, who("bob"))
    assert "e" in table


def test_a_relayed_session_is_kept_for_the_tenant_that_ends_it():
    table, *_ = make()
    ran(table, "a", 8, caller=who("stage0", peer=True))  # a peer relayed its steps here
    assert table.keep("a", keys("k0", "k1"), CHUNK, who("alice"))
    assert table.entries[0].owner == "alice"
    assert table.adopt("b", 1, keys("k0"), CHUNK, who("alice")) is not None


@pytest.mark.parametrize("case", ["off", "no keys", "more than it holds", "busy"])
def test_what_the_store_does_not_take_is_released(case):
    table, eng, _, events = make(entries=0 if case == "off" else 3)
    ran(table, "a", 8)
    ks = {"no keys": [], "more than it holds": keys("k0", "k1", "k2")}.get(case, keys("k0"))
    if case == "busy":
        table.acquire("a", 1, 8, 1)
    assert not table.keep("a", ks, CHUNK)
    assert "a" not in table and not table.entries and table.free_slots == 3
    assert events[-1][0] == "release"


def test_a_session_that_needs_a_slot_takes_the_least_recently_used_entrys():
    table, eng, clock, events = make(n_slots=3)
    ran(table, "a", 4)
    ran(table, "b", 4)
    assert table.keep("a", keys("a0"), CHUNK)
    clock.t += 1
    assert table.keep("b", keys("b0"), CHUNK)
    clock.t += 1
    assert table.adopt("x", 1, keys("a0"), CHUNK)[2]  # a copy (a free slot): "a" used last
    ran(table, "c", 1)  # no free slot: the least recently used entry ("b") goes
    assert [e.keys for e in table.entries] == [tuple(keys("a0"))]
    assert table.prefix_evictions == 1 and events[-2][0] == "evict"


def test_the_store_holds_at_most_its_size_and_a_longer_entry_replaces_its_prefix():
    table, eng, clock, _ = make(n_slots=4, entries=2)
    for name in "abc":
        ran(table, name, 8)
    assert table.keep("a", keys("k0"), CHUNK)
    clock.t += 1
    assert table.keep("b", keys("k0", "k1"), CHUNK)  # holds a's positions and more
    assert [len(e.keys) for e in table.entries] == [2] and table.prefix_evictions == 1
    clock.t += 1
    ran(table, "d", 8)
    assert table.keep("c", keys("m0"), CHUNK)
    assert table.keep("d", keys("n0"), CHUNK)  # a third: the oldest goes
    assert [e.keys for e in table.entries] == [tuple(keys("m0")), tuple(keys("n0"))]
    assert table.free_slots == 4


def test_entries_expire_with_the_ttl_and_clear_drops_them():
    table, eng, clock, _ = make()
    ran(table, "a", 8)
    ran(table, "b", 8)
    table.keep("a", keys("k0"), CHUNK)
    clock.t += 61
    table.expire()
    assert not table.entries and table.prefix_evictions == 1
    ran(table, "c", 4, epoch=1)
    table.keep("c", keys("c0"), CHUNK)
    table.clear()
    assert not table.entries and not len(table) and table.free_slots == 3


def test_adopt_refuses_an_existing_session_and_a_draining_table():
    table, *_ = make()
    ran(table, "a", 8)
    ran(table, "b", 8)
    table.keep("a", keys("k0"), CHUNK)
    with pytest.raises(errors.SessionError, match="exists already"):
        table.adopt("b", 2, keys("k0"), CHUNK)
    table.closed = True
    with pytest.raises(errors.SessionError, match="draining"):
        table.adopt("c", 1, keys("k0"), CHUNK)


def test_a_tenants_cap_counts_adopted_sessions():
    table, *_ = make()
    table.max_sessions_per_owner = 1
    ran(table, "a", 8, caller=who("alice"))
    table.keep("a", keys("k0"), CHUNK, who("alice"))
    assert table.adopt("b", 1, keys("k0"), CHUNK, who("alice")) is not None
    with pytest.raises(errors.ResourceExhausted):
        table.adopt("c", 1, keys("k0"), CHUNK, who("alice"))


def test_the_keys_name_the_tokens_before_them_and_the_salt():
    seed = prefix.salt(["model/settings"], CHUNK, "alice")
    toks = list(range(3, 20))  # four whole chunks and one token
    ks = prefix.chain(toks, CHUNK, seed)
    assert len(ks) == 4 and len(set(ks)) == 4
    assert all(len(k) == prefix.KEY_BYTES for k in ks)
    assert prefix.chain(toks, CHUNK, seed, 2) == ks[:2]
    # a token changed in chunk 2 changes key 2 and every key after it, none before
    other = toks[:9] + [999] + toks[10:]
    ko = prefix.chain(other, CHUNK, seed)
    assert ko[:2] == ks[:2] and all(a != b for a, b in zip(ko[2:], ks[2:]))
    # another tenant, chunking or model names other keys for the same tokens
    for s in (prefix.salt(["model/settings"], CHUNK, "bob"),
              prefix.salt(["model/settings"], CHUNK + 1, "alice"),
              prefix.salt(["other/settings"], CHUNK, "alice")):
        assert not set(prefix.chain(toks, CHUNK, s)) & set(ks)
    assert prefix.salt(["m"], 4, None) == prefix.salt(["m"], 4, "")
    with pytest.raises(ValueError):
        prefix.chain(toks, 0, seed)
