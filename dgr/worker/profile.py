"""Where a stage's time goes: wall seconds by part of its work, summed over its threads.

A stage's work on a step, in order (docs/performance.md has a measured breakdown):

- ``frame_in``: a data-plane frame, once received: the frame's decode and the step's
  admission checks (``StagePipeline.accept``), on the connection's reader thread;
- ``lease``: a batch about to run takes the engine's lock, then the session table's leases,
  the deferred slot releases and rollbacks;
- ``engine``: the engine's forward (``Engine.forward_batch``): the engine's own counters split
  it further (``Engine.counters``: ``llama_decode`` and the rest, ubatches, graphs reused);
- ``sample``: the last stage's sampling of the rows it computed;
- ``commit``: the session table's commit (or abort) of each step, and the counters;
- ``turn_wait``: a computed batch waits for the batches computed before it to hand on;
- ``hand_on``: the batch's frames are encoded and sent (relay, decode loop, reply);
- ``held``: the stage loop waits while steps are queued (the rest of a burst, or a compute
  on another thread);
- ``idle``: the stage loop waits with nothing queued.

Each thread adds to its own totals (no lock on the hot path); ``totals`` sums them.
"""

from __future__ import annotations

import threading

__all__ = ["PARTS", "Profile"]

#: the parts of a stage's work, in the order a step meets them
PARTS = ("frame_in", "lease", "engine", "sample", "commit", "turn_wait", "hand_on", "held",
         "idle")


class Profile:
    """Wall seconds per part (``PARTS``) since the stage started, summed over its threads."""

    def __init__(self):
        self._tls = threading.local()
        self._all: list[dict[str, float]] = []
        self._lock = threading.Lock()

    def add(self, part: str, seconds: float) -> None:
        d = getattr(self._tls, "d", None)
        if d is None:
            d = self._tls.d = dict.fromkeys(PARTS, 0.0)
            with self._lock:
                self._all.append(d)
        d[part] += seconds

    def totals(self) -> dict[str, float]:
        """Seconds per part, every thread's (those that ended too)."""
        with self._lock:
            ds = list(self._all)
        return {p: sum(d[p] for d in ds) for p in PARTS}
