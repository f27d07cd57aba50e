"""A link emulator: an asyncio TCP proxy that delays, rate-limits, stalls, drops or cuts.

The kernels dgr is tested on have no ``netem`` qdisc, so latency and faults between stages
come from this proxy: put it between the route driver and a worker (``listen`` -> ``target``)
and point the driver at ``endpoint``.

- ``delay_ms``: added to every byte, per direction (an RTT of R ms is ``delay_ms=R/2``).
  Delivery times are kept to well under a millisecond: the last 4 ms are slept with a
  blocking ``time.sleep`` (the event loop's timers round up to whole milliseconds).
- ``rate_bps``: bandwidth cap per direction (bytes per second; None: no cap).
- ``stall()``: stop forwarding silently (connections stay open, bytes are held) until
  ``resume()``: a hung link, seen by the peer only through its deadline.
- ``drop()``: discard every byte silently in both directions until ``resume()`` (the
  streams are then corrupt: use it to kill a link without telling either end).
- ``cut()``: reset every open connection now (RST); ``refuse(True)``: reset new ones too.

In-process use: ``LinkEmulator(target).start()`` runs it on a thread of its own. A process
of its own (benchmarks, so the proxy does not share the interpreter lock with the driver)::

    python -m dgr.testing.linkemu --target HOST:PORT --delay-ms 10

prints ``LISTENING host:port`` and takes commands on stdin, one a line: ``stall``,
``resume``, ``drop``, ``cut``, ``refuse``, ``accept``, ``delay MS``, ``rate BPS``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import sys
import threading
import time

__all__ = ["LinkEmulator", "main"]

_CHUNK = 1 << 16
_SPIN = 0.004  # the event loop's timers can be a few ms late on a busy machine


class LinkEmulator:
    """A TCP proxy from ``listen`` to ``target`` with per-direction delay and rate limit."""

    def __init__(self, target: str, listen: str = "127.0.0.1:0", *, delay_ms: float = 0.0,
                 rate_bps: float | None = None):
        self.target = target
        self.listen = listen
        self.delay = delay_ms / 1e3
        self.rate = rate_bps
        self.endpoint: str | None = None
        self.connections = 0        # accepted so far
        self.bytes = [0, 0]         # forwarded to target, back to client
        self._flowing: asyncio.Event | None = None
        self._dropping = False
        self._refusing = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()  # one per proxied connection
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- control (thread-safe when started with start()) ------------------------------------

    def _call(self, fn, *args):
        if self._loop is not None and self._thread is not None \
                and threading.current_thread() is not self._thread:
            done = threading.Event()

            def run():
                try:
                    fn(*args)
                finally:
                    done.set()

            self._loop.call_soon_threadsafe(run)
            done.wait(5)
        else:
            fn(*args)

    def stall(self) -> None:
        self._call(lambda: self._flowing.clear())

    def resume(self) -> None:
        def go():
            self._dropping = False
            self._flowing.set()
        self._call(go)

    def drop(self) -> None:
        def go():
            self._dropping = True
            self._flowing.set()
        self._call(go)

    def cut(self) -> None:
        self._call(self._cut)

    def refuse(self, on: bool = True) -> None:
        def go():
            self._refusing = on
        self._call(go)

    def set_delay(self, ms: float) -> None:
        self.delay = ms / 1e3

    def set_rate(self, bps: float | None) -> None:
        self.rate = bps

    def _cut(self) -> None:
        for w in list(self._writers):
            _reset(w)
        self._writers.clear()

    # -- running ---------------------------------------------------------------------------

    async def serve(self) -> str:
        """Start listening in the running loop; returns ``host:port``."""
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._dropping = False
        host, port = self.listen.rsplit(":", 1)
        self._server = await asyncio.start_server(self._accept, host, int(port))
        h, p = self._server.sockets[0].getsockname()[:2]
        self.endpoint = f"{h}:{p}"
        return self.endpoint

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self._dropping = True  # a stalled pump moves on (and drops what it still holds)
        if self._flowing is not None:
            self._flowing.set()
        self._cut()
        # the cut connections end their pumps: let them finish, so nothing is left pending
        # when the loop stops (cancelling a connection's task makes asyncio's streams log it)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=2)

    def start(self) -> LinkEmulator:
        """Run on a daemon thread of its own; returns once listening."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self.serve())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="dgr-linkemu", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the link emulator did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self.aclose(), self._loop)
        try:
            fut.result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
            self._loop = None

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._proxy(cr, cw)
        finally:
            self._tasks.discard(task)

    async def _proxy(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        _nodelay(cw)
        if self._refusing:
            _reset(cw)
            return
        host, port = self.target.rsplit(":", 1)
        try:
            tr, tw = await asyncio.open_connection(host, int(port))
        except OSError:
            _reset(cw)
            return
        _nodelay(tw)
        self._writers.update((cw, tw))
        try:
            await asyncio.gather(self._pump(cr, tw, 0), self._pump(tr, cw, 1))
        finally:
            for w in (cw, tw):
                self._writers.discard(w)
                if not w.is_closing():
                    w.close()

    async def _pump(self, reader, writer, direction: int) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def read():
            try:
                while True:
                    data = await reader.read(_CHUNK)
                    q.put_nowait((time.monotonic() + self.delay, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                q.put_nowait((0.0, b""))

        task = asyncio.ensure_future(read())
        next_free = 0.0
        try:
            while True:
                due, data = await q.get()
                if not data:
                    break
                await _until(due)
                if self.rate:
                    await _until(next_free)
                    next_free = max(time.monotonic(), next_free) + len(data) / self.rate
                if not self._flowing.is_set():
                    await self._flowing.wait()
                if self._dropping:
                    continue
                writer.write(data)
                self.bytes[direction] += len(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _until(t: float) -> None:
    left = t - time.monotonic()
    if left > _SPIN:
        await asyncio.sleep(left - _SPIN)
        left = t - time.monotonic()
    if left > 0:
        time.sleep(left)  # sub-millisecond precision (blocks the loop at most _SPIN s)


def _nodelay(w: asyncio.StreamWriter) -> None:
    s = w.get_extra_info("socket")
    if s is not None:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _reset(w: asyncio.StreamWriter) -> None:
    s = w.get_extra_info("socket")
    if s is not None:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    w.transport.abort()


async def _amain(args) -> int:
    emu = LinkEmulator(args.target, args.listen, delay_ms=args.delay_ms, rate_bps=args.rate)
    ep = await emu.serve()
    print(f"LISTENING {ep}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd, *rest = line.split() or [""]
        if cmd == "stall":
            emu.stall()
        elif cmd == "resume":
            emu.resume()
        elif cmd == "drop":
            emu.drop()
        elif cmd == "cut":
            emu.cut()
        elif cmd in ("refuse", "accept"):
            emu.refuse(cmd == "refuse")
        elif cmd == "delay" and rest:
            emu.set_delay(float(rest[0]))
        elif cmd == "rate" and rest:
            emu.set_rate(float(rest[0]) or None)
        elif cmd == "quit":
            break
        print(f"OK {cmd}", flush=True)
    await emu.aclose()
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in rest:
        t.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.testing.linkemu",
                                description="TCP proxy with delay, rate cap, stall, drop, cut.")
    p.add_argument("--target", required=True, help="host:port to forward to")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added delay per direction")
    p.add_argument("--rate", type=float, default=None, help="bytes/s per direction")
    return asyncio.run(_amain(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
