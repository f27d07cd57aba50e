"""An ASGI app served by uvicorn from a thread, for tests of the HTTP front."""

from __future__ import annotations

import threading
import time

__all__ = ["Served"]


class Served:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread; ``base`` is its
    ``http://host:port``. Raises AssertionError when it does not start within ``timeout``."""

    def __init__(self, app, timeout: float = 30.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self.thread.is_alive(), "uvicorn exited at startup"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.host, self.port = "127.0.0.1", port
        self.base = f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
