"""A worker's describe (and the capability record inside it) reads the session table under
the table's lock, the one its writers hold: data-plane threads insert sessions into the
table while the event loop describes, and ``free_context`` iterates over the sessions."""

from __future__ import annotations

import threading

import pytest

import dgr
from dgr.worker.worker import Worker


class OwnedLock:
    """A re-entrant lock that can say whether the calling thread holds it."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def held(self) -> bool:
        return self._owner == threading.get_ident()


class WatchedTable:
    """The worker's SessionTable, recording whether each read of its facts held ``lock``."""

    def __init__(self, table, lock: OwnedLock):
        self._table, self._lock = table, lock
        self.reads: list[tuple[str, bool]] = []

    def __getattr__(self, name):
        return getattr(self._table, name)

    def __len__(self) -> int:
        self.reads.append(("len", self._lock.held()))
        return len(self._table)

    @property
    def free_slots(self) -> int:
        self.reads.append(("free_slots", self._lock.held()))
        return self._table.free_slots

    @property
    def free_context(self) -> int:
        self.reads.append(("free_context", self._lock.held()))
        return self._table.free_context


@pytest.fixture()
def worker(tiny_llama):
    w = Worker(dgr.Engine(tiny_llama, n_ctx=64, n_slots=2, n_threads=1, n_ubatch=8))
    yield w
    w.pipeline.scheduler.stop()


def test_describe_reads_the_table_under_its_lock(worker):
    p = worker.pipeline
    lock = OwnedLock()
    p.lock = lock
    table = p.table
    with lock:  # a session as a data-plane step leaves it: acquired and committed
        table.commit(table.acquire("s1", 1, 0, 5))
    watched = p.table = WatchedTable(table, lock)
    d = worker.describe()
    assert d["sessions"] == 1 and d["free_slots"] == 1 and d["free_context"] == 2 * 64 - 5
    assert d["capability_json"], "the capability record failed (see the log)"
    # describe's own reads and the capability record's
    names = [name for name, _ in watched.reads]
    assert names.count("free_context") == 2 and names.count("len") == 2, names
    assert names.count("free_slots") == 2, names
    unlocked = [name for name, held in watched.reads if not held]
    assert unlocked == [], f"read without the table lock: {unlocked}"


def test_describe_does_not_wait_for_the_engine(worker):
    """Describe runs on the worker's event loop: it must not take the engine's lock, which
    every compute holds (a describe that waited for a forward stalled admission, health
    checks and the driver's responsiveness probe for the whole compute). The device facts it
    reports were read when the worker started."""
    got: dict = {}
    with worker.pipeline.engine.lock:  # a compute in progress on another thread
        t = threading.Thread(target=lambda: got.update(worker.describe()), daemon=True)
        t.start()
        t.join(60)
        finished_while_held = not t.is_alive()
    assert finished_while_held, "describe waited for the engine's lock"
    assert got["device"]["backend"] == "cpu" and got["device"]["weight_bytes"] > 0
    assert got["capability_json"], "the capability record failed (see the log)"
