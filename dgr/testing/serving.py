"""An ASGI app served by uvicorn from a thread, for tests of the HTTP front."""

from __future__ import annotations

import threading
import time

__all__ = ["Served"]


class Served:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread; ``base`` is its
    ``http://host:port``. Raises AssertionError when it does not start within ``timeout``.

    ``openai()`` and ``anthropic()`` give official clients of it, closed by ``stop()`` (a
    client left to the garbage collector leaves its pooled sockets open until then, and a
    ResourceWarning fails whichever test is running when they are collected)."""

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
        self.clients: list = []

    def openai(self, api_key: str = "unused", timeout: float = 60.0, **kw):
        """An ``openai.OpenAI`` client of this server (no retries), closed by ``stop()``."""
        import openai

        return self._keep(openai.OpenAI(base_url=self.base + "/v1", api_key=api_key,
                                        max_retries=0, timeout=timeout, **kw))

    def anthropic(self, api_key: str = "unused", timeout: float = 60.0, **kw):
        """An ``anthropic.Anthropic`` client of this server (no retries), closed by
        ``stop()``."""
        import anthropic

        return self._keep(anthropic.Anthropic(base_url=self.base, api_key=api_key,
                                              max_retries=0, timeout=timeout, **kw))

    def _keep(self, client):
        self.clients.append(client)
        return client

    def stop(self, timeout: float = 30.0) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()
        self.server.should_exit = True
        self.thread.join(timeout)
