"""The engine's one lock: every call into the C++ engine holds ``Engine.lock`` (the C++ engine
keeps no mutex of its own), so a caller holding it makes a sequence of calls atomic."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dgr


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return dgr.Engine(tiny_llama, n_ctx=64, n_slots=2)


def test_a_forward_waits_for_the_lock_holder(engine):
    done = threading.Event()
    failed: list[BaseException] = []

    def other():
        try:
            engine.forward(1, [0], [1])
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)
        done.set()

    with engine.lock:
        t = threading.Thread(target=other, daemon=True)
        t.start()
        # while held, the other thread's forward cannot have run: its slot is still empty
        assert not done.wait(0.5)
        assert engine.next_pos(1) == 0  # re-entrant: the holder may call the engine
    assert done.wait(60), "the forward did not run once the lock was released"
    t.join(10)
    assert not failed, failed
    assert engine.next_pos(1) == 1
    engine.release(1)


def test_the_lock_is_reentrant_and_per_engine(engine, tiny_llama):
    other = dgr.Engine(tiny_llama, n_ctx=64)
    assert engine.lock is not other.lock
    with engine.lock, engine.lock:
        out = engine.forward(0, np.arange(2, dtype=np.int32), [1, 2])
    assert out.shape[0] == 1
    engine.release(0)
