"""Who owns what in a worker: the ``Worker`` owns its step pipeline (it is not one), and the
pipeline owns the engine, the session table and the scheduler, which computes through that
same pipeline. The worker's session calls act for the caller (``CALLER``). No model: a
stand-in engine (``stand_in``, tests/unit/conftest.py)."""

from __future__ import annotations

import pytest

from dgr.transport.security import CALLER, Credential
from dgr.worker.config import WorkerConfig
from dgr.worker.pipeline import StagePipeline
from dgr.worker.scheduler import StageLoop
from dgr.worker.sessions import SessionTable
from dgr.worker.slots import Slots
from dgr.worker.worker import Worker


@pytest.fixture()
def worker(stand_in):
    w = Worker(stand_in, ttl=30.0, max_sessions_per_credential=2, max_queued_per_credential=5,
               prefix_entries=1, batching=False)
    yield w
    w.pipeline.scheduler.stop()


def test_the_worker_owns_its_pipeline_which_owns_the_engine_table_and_scheduler(worker,
                                                                              stand_in):
    p = worker.pipeline
    assert not isinstance(worker, StagePipeline) and isinstance(p, StagePipeline)
    assert p.engine is stand_in and isinstance(p.table, SessionTable)
    assert isinstance(p.scheduler, StageLoop) and p.scheduler.p is p
    assert isinstance(p.slots, Slots) and p.slots.table is p.table and p.slots.engine is p.engine
    # the pipeline reads its settings from the worker's one config
    assert p.table.ttl == 30.0 and p.table.max_sessions_per_owner == 2
    assert p.max_queued_per_credential == 5 and p.table.prefix_entries == 1
    assert p.scheduler.batching is False
    assert p.scheduler.max_tokens == stand_in.settings["n_ubatch"]
    # the server's health hook list is the pipeline's (a lost device calls it)
    assert worker.on_unservable is p.on_unservable


def test_the_pipeline_alone_has_the_defaults_of_a_worker_config(stand_in):
    p = StagePipeline(stand_in)
    try:
        c = WorkerConfig()
        assert p.table.ttl == c.ttl and p.scheduler.batching == c.batching
        assert p.table.prefix_entries == stand_in.n_slots  # every slot by default
        assert p.relay_policy.allows("127.0.0.1:5000")  # loopback only by default
        assert not p.relay_policy.allows("10.0.0.1:5000")
    finally:
        p.scheduler.stop()


def test_the_workers_release_acts_for_the_caller(worker):
    table = worker.pipeline.table
    alice = Credential("alice", b"a" * 16)
    bob = Credential("bob", b"b" * 16)
    with worker.pipeline.lock:
        table.commit(table.acquire("s", 1, 0, 4, alice))
    token = CALLER.set(bob)
    try:
        assert worker.release("s") == (False, False)  # another tenant's session stays
    finally:
        CALLER.reset(token)
    assert "s" in table
    token = CALLER.set(alice)
    try:
        assert worker.release("s") == (True, False)
    finally:
        CALLER.reset(token)
    assert "s" not in table
