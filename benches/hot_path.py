"""The Python cost of one relayed step in a worker, warm and right after a real compute.

    python benches/hot_path.py [--steps 300]

Runs ``Worker._data_frame`` (the data plane's per-frame path: decode, checks, session table,
compute, encode of the next hop's frame) in this process on a middle range of SmolLM2, with
the send stubbed out, two ways:

* warm: a stand-in engine that copies the boundary (no compute), so caches stay hot;
* real: the range engine itself; the figure is the step's wall time minus the engine's own
  compute (``Worker.window``), i.e. the same Python right after a ~4 ms compute has gone
  through the caches.

The difference between the two is what a seam costs beyond its Python when the CPU caches
are cold, which is the situation of every stage of a route.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.common import SETTINGS, smollm2_path  # noqa: E402


class _NoSend:
    def send(self, endpoint, frame) -> None:
        pass


class _CopyEngine:
    """Stands in for a middle range: returns the boundary it was given (no compute)."""

    needs_token_ids = False

    def __init__(self):
        import threading

        self.lock = threading.RLock()  # the engine's one lock, as dgr.Engine's

    def forward(self, slot, positions, tokens, boundary=None, out=None, logits=None):
        n = len(boundary)
        out[:n] = boundary
        return out[:n]

    def release(self, slot) -> None:
        pass


def _frames(worker, x, n, epoch):
    from dgr.protocol import wire

    hop = [wire.Hop(endpoint="127.0.0.1:1")]
    return [wire.encode(wire.Forward(model=worker.identity, session="s", epoch=epoch,
                                     first_pos=p, n_tokens=1, layer=worker.layers[0],
                                     relay=hop, reply_to="r"), x) for p in range(n)]


def _run(worker, frames) -> list[float]:
    """Per step: wall time minus the engine's compute (ms)."""
    out = []
    for f in frames:
        t = time.perf_counter()
        worker._data_frame(None, memoryview(f))
        dt = time.perf_counter() - t
        out.append(1e3 * (dt - worker.window.items[-1][2]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)

    import numpy as np

    import dgr
    from dgr.worker.relay import Forwarder
    from dgr.worker.stage import Worker

    settings = {**SETTINGS, "n_slots": 1}
    eng = dgr.Engine(smollm2_path(), layers=(10, 20), **settings)
    w = Worker(eng)
    w.forwarder = Forwarder(w.layers[1], w.is_first, w.is_last)
    w.forwarder.links = _NoSend()
    w._tls.out, w._tls.buf = None, bytearray()
    x = np.random.default_rng(0).standard_normal((1, w.width), dtype=np.float32)
    n = min(args.steps, settings["n_ctx"] - 1)

    real = _run(w, _frames(w, x, n, 1))
    compute = 1e3 * statistics.median(s for _, _, s in list(w.window.items)[-n:])
    w.engine = _CopyEngine()
    warm = _run(w, _frames(w, x, n, 2))
    skip = min(20, n // 4)
    print(f"relayed step in a worker, layers [10, 20) of SmolLM2, {n} steps "
          f"(median after {skip}):")
    print(f"  Python per step, warm (no compute):        "
          f"{1e3 * statistics.median(warm[skip:]):7.1f} us")
    print(f"  Python per step, after a real compute:     "
          f"{1e3 * statistics.median(real[skip:]):7.1f} us  "
          f"(engine compute {compute:.2f} ms)")
    print(f"  load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
