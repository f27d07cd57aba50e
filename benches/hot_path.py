"""The per-frame cost of one relayed step in a worker, warm and right after a real compute,
with the native frame path (C++ receive, checks, encode, gather send) and the Python one.

    python benches/hot_path.py [--steps 300]

Runs a data-plane connection's per-frame path in this process on a middle range of SmolLM2:
``conn.recv()`` then ``Worker._data_frame`` (receive, decode and checks, session table,
compute, the next hop's frame, its send), with real sockets: each frame waits in a socket pair
before the clock starts, and the relayed frame goes into another whose far end a thread
drains. Two ways each, for ``Worker(native_frames=True)`` and ``False``:

* warm: a stand-in engine that copies the boundary (no compute), so caches stay hot;
* real: the range engine itself; the figure is the step's wall time minus the engine's own
  compute (``Worker.window``), i.e. the same work right after a ~4 ms compute has gone
  through the caches.

The difference between the two is what a seam costs beyond its code when the CPU caches
are cold, which is the situation of every stage of a route.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from harness import cli
from harness.common import SETTINGS, smollm2_path


class _Sink:
    """Stands in for the relay links: frames go into a socket pair, drained by a thread."""

    def __init__(self, conn_class):
        import socket
        import threading

        a, b = socket.socketpair()
        self.link = conn_class(a, "sink")
        self.far = b
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while self.far.recv(1 << 20):
            pass

    def send(self, endpoint, frame, payload=None, on_error=None) -> None:
        """``Links.send``'s signature (no burst here: every frame leaves at once)."""
        self.link.send_parts(frame, payload)

    def close(self) -> None:
        self.link.close()
        self.far.close()


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
    return [wire.encode(wire.Forward(model=worker.pipeline.identity, session="s", epoch=epoch,
                                     first_pos=p, n_tokens=1, layer=worker.pipeline.layers[0],
                                     relay=hop, reply_to="r"), x) for p in range(n)]


def _run(worker, frames, conn, writer) -> list[float]:
    """Per step: wall time of receive + ``_data_frame`` minus the engine's compute (ms)."""
    from dgr.transport.dataplane import LEN

    out = []
    for f in frames:
        writer.sendall(LEN.pack(len(f)) + f)  # waiting in the socket before the clock starts
        t = time.perf_counter()
        worker._data_frame(conn, conn.recv())
        dt = time.perf_counter() - t
        out.append(1e3 * (dt - worker.pipeline.window.items[-1][2]))
    return out


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)

    import socket

    import numpy as np

    import dgr
    from dgr.worker.forwarder import Forwarder
    from dgr.worker.worker import Worker

    settings = {**SETTINGS, "n_slots": 1}
    eng = dgr.Engine(smollm2_path(), layers=(10, 20), **settings)
    n = min(args.steps, settings["n_ctx"] - 1)
    skip = min(20, n // 4)
    print(f"relayed step in a worker, layers [10, 20) of SmolLM2, {n} steps "
          f"(median after {skip}), receive to relayed send:")
    epoch = 0
    for native in (True, False):
        w = Worker(eng, native_frames=native)
        p = w.pipeline
        w.forwarder = Forwarder(p.layers[1], p.is_first, p.is_last, w.frames)
        w.forwarder.links = sink = _Sink(w.frames.conn_class)
        p._tls.out, w._tls.buf = None, bytearray()
        a, b = socket.socketpair()
        conn = w.frames.conn_class(a, "bench")
        x = np.random.default_rng(0).standard_normal((1, p.width), dtype=np.float32)
        epoch += 1
        real = _run(w, _frames(w, x, n, epoch), conn, b)
        compute = 1e3 * statistics.median(s for _, _, s in list(p.window.items)[-n:])
        p.engine = _CopyEngine()
        epoch += 1
        warm = _run(w, _frames(w, x, n, epoch), conn, b)
        p.scheduler.stop()
        p.engine = eng
        with eng.lock:
            eng.release(0)
        name = "native" if w.frames.native else "python"
        print(f"  {name}: per step, warm (no compute):     "
              f"{1e3 * statistics.median(warm[skip:]):7.1f} us")
        print(f"  {name}: per step, after a real compute:  "
              f"{1e3 * statistics.median(real[skip:]):7.1f} us  "
              f"(engine compute {compute:.2f} ms)")
        conn.close()
        b.close()
        sink.close()
    print(f"  load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
