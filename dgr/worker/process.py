"""Running workers: in this process (a thread), or as ``python -m dgr.worker`` child processes."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Sequence

from dgr import errors
from dgr.protocol import settings as engine_settings
from dgr.transport.server import ShardServer
from dgr.worker.worker import Worker

__all__ = ["ThreadedWorker", "WorkerProcess", "LocalCluster", "worker_env"]


class ThreadedWorker:
    """Serve an engine from a background thread of this process (tests, embedding).

    Parameters are ``Worker``'s plus ``listen`` and ``data_port`` (the fast data plane's port; 0: any
    free one, None: no data plane); ``address`` is the bound ``host:port``.
    """

    def __init__(self, engine, listen: str = "127.0.0.1:0", *, data_port: int | None = 0,
                 **worker_kw):
        import threading

        self.event_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.event_loop.run_forever, name="dgr-worker",
                                        daemon=True)
        self._thread.start()
        self.worker = Worker(engine, **worker_kw)

        async def start() -> ShardServer:
            srv = ShardServer(self.worker, listen, security=self.worker.security)
            await srv.start()
            return srv

        try:
            self.server = self._run(start())
        except BaseException:
            self._close_loop()
            raise
        self.address = self.server.address
        self.worker.name = self.address
        if data_port is not None:
            self.worker.serve_data(self.address.rsplit(":", 1)[0], data_port)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.event_loop).result()

    def drain(self, timeout: float = 10.0) -> None:
        """What SIGTERM does to a worker process: refuse new work, finish, stop serving."""
        self._run(self.worker.drain(self.server, timeout))

    def stop(self) -> None:
        if self.event_loop.is_running():
            self._run(self.server.stop(None))  # a no-op after drain()
            self.worker.stop_data()
            self.worker.pipeline.scheduler.stop()
        self._close_loop()

    def _close_loop(self) -> None:
        if self.event_loop.is_running():
            self.event_loop.call_soon_threadsafe(self.event_loop.stop)
            self._thread.join(5)
        if not self.event_loop.is_running() and not self.event_loop.is_closed():
            self.event_loop.close()

    def __enter__(self) -> ThreadedWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


#: Thread pools of numeric libraries a worker does not want: numpy's BLAS would start one
#: spinning thread per core next to the engine's own (measured: a few % of every core).
_QUIET_POOLS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_env(base: dict | None = None) -> dict:
    """The environment for a worker process: ``base`` (default ``os.environ``) with the
    numeric libraries' own thread pools at one thread unless the caller set them."""
    env = dict(os.environ if base is None else base)
    for k in _QUIET_POOLS:
        env.setdefault(k, "1")
    return env


class WorkerProcess:
    """A ``python -m dgr.worker`` child process.

    ``start()`` launches it, ``wait_listening()`` waits for its ``LISTENING host:port`` line,
    ``stop()`` sends SIGTERM and waits (then SIGKILL), ``kill()`` kills it. Its stderr (the
    session log) goes to ``log_path``.

    Parameters
    ----------
    model : str
        GGUF path.
    layers : (int, int), optional
        The range to serve (None: the whole model).
    listen : str
        ``host:port`` (port 0: any free port; ``endpoint`` tells which once listening).
    settings : dict
        Engine settings (``n_ctx``, ``n_slots``, ``n_threads``, ``n_ubatch``, ``flash_attn``,
        ``type_k``, ``type_v``); missing ones take the worker's defaults.
    args : sequence of str
        More command-line arguments for the worker.
    log_path : str, optional
        Where stderr goes (default: a temporary file).
    """

    def __init__(self, model: str, layers: tuple[int, int] | None = None, *,
                 listen: str = "127.0.0.1:0", settings: dict | None = None,
                 args: Sequence[str] = (), log_path: str | None = None):
        self.model = str(model)
        self.layers = layers
        self.listen = listen
        self.settings = dict(settings or {})
        self.args = list(args)
        self.log_path = log_path
        self.proc = None
        self.endpoint: str | None = None
        self.returncode: int | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "dgr.worker", "--model", self.model, "--listen",
               self.listen, "--parent-pid", str(os.getpid())]
        if self.layers is not None:
            cmd += ["--layers", f"{self.layers[0]}:{self.layers[1]}"]
        return cmd + engine_settings.to_argv(self.settings) + self.args

    def start(self) -> WorkerProcess:
        import subprocess
        import tempfile

        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="dgr-worker-", suffix=".log")
            os.close(fd)
        log_file = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=log_file,
                                         start_new_session=True, env=worker_env())
        finally:
            log_file.close()
        self.returncode = None
        return self

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except (OSError, TypeError):
            return ""
        return "\n".join(lines[-n:])

    def wait_listening(self, timeout: float = 120.0) -> str:
        """Wait for the ``LISTENING`` line; returns the endpoint.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            The worker exited or did not listen in time (the message has its log's tail).
        """
        import selectors

        if self.endpoint is not None and self.proc is not None:
            return self.endpoint
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf = b""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.WorkerUnavailable(
                        f"worker {self.layers} did not listen within {timeout:g} s:\n"
                        f"{self.log_tail()}")
                if sel.select(min(left, 0.2)):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        self.proc.wait()
                        raise errors.WorkerUnavailable(
                            f"worker {self.layers} exited with status {self.proc.returncode} "
                            f"before listening:\n{self.log_tail()}")
                    buf += chunk
                    for line in buf.decode("utf-8", "replace").splitlines():
                        if line.startswith("LISTENING "):
                            self.endpoint = line.split()[1]
                            return self.endpoint
        finally:
            sel.close()

    def stop(self, timeout: float = 30.0, *, signalled: bool = False) -> int:
        """SIGTERM (drain), wait up to ``timeout``, then SIGKILL; returns the exit status.

        ``signalled``: SIGTERM was already sent (do not send another).
        """
        import subprocess

        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            if not signalled:
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._reap()

    def kill(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        return self._reap()

    def _reap(self) -> int:
        self.returncode = self.proc.returncode
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.returncode

    def restart(self, timeout: float = 120.0) -> str:
        """Start it again under the same address (the bound port, once known)."""
        if self.endpoint is not None:
            self.listen = self.endpoint
        self.endpoint = None
        self.start()
        return self.wait_listening(timeout)


class LocalCluster:
    """Worker processes for a list of layer ranges on loopback; reaps them on exit.

    ``progress(i, n, message)`` is called as each worker starts listening.
    """

    def __init__(self, model: str, ranges: Sequence[tuple[int, int] | None], *,
                 settings: dict | None = None, args: Sequence[str] = (),
                 host: str = "127.0.0.1", first_args: Sequence[str] = ()):
        self.workers = [WorkerProcess(model, r, listen=f"{host}:0", settings=settings,
                                      args=[*args, *(first_args if not i else ())])
                        for i, r in enumerate(ranges)]

    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    def start(self, timeout: float = 120.0, progress=None) -> list[str]:
        try:
            for w in self.workers:  # all load at once
                w.start()
            for i, w in enumerate(self.workers):
                w.wait_listening(timeout)
                if progress is not None:
                    r = w.layers
                    what = "all layers" if r is None else f"layers [{r[0]}, {r[1]})"
                    progress(i, len(self.workers), f"worker {i + 1}/{len(self.workers)} "
                                                   f"{what} listening on {w.endpoint}")
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM every worker at once, then reap each; returns their exit statuses."""
        sent = []
        for w in self.workers:
            live = w.proc is not None and w.proc.poll() is None
            if live:
                w.proc.terminate()
            sent.append(live)
        return [w.stop(timeout, signalled=s) for w, s in zip(self.workers, sent)]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
