"""Bounded waits for tests: poll a condition, or read a child's pipe, with a deadline, so a
hang becomes a failure that says what did not happen (never a test that hangs, never a sleep
used as synchronisation)."""

from __future__ import annotations

import asyncio
import os
import selectors
import threading
import time
from typing import Awaitable, Callable

__all__ = ["WAIT_S", "wait_until", "poll_until", "read_until"]

#: the default deadline of a wait on a condition (generous: a loaded CI machine)
WAIT_S = 60.0


def wait_until(cond: Callable[[], object], what: str, timeout: float = WAIT_S,
               every: float = 0.005):
    """Poll ``cond()`` every ``every`` seconds until it holds and return what it gave; raise
    AssertionError naming ``what`` if it does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        threading.Event().wait(every)
    return got


async def poll_until(probe: Callable[[], Awaitable[object]], what: str,
                     timeout: float = WAIT_S, every: float = 0.02):
    """``wait_until`` on an event loop: await ``probe()`` until it gives something true and
    return it; raise AssertionError naming ``what`` (and the last answer) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (got := await probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s (last: {got!r})")
        await asyncio.sleep(every)
    return got


def read_until(stream, done: Callable[[bytes], bool], timeout: float, what: str) -> bytes:
    """Bytes read from the pipe ``stream`` until ``done(bytes so far)`` or end of file;
    raise AssertionError ("``what`` within ``timeout`` s") when neither comes in time."""
    fd, got = stream.fileno(), b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not done(got):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"{what} within {timeout:g} s: {got!r}")
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    return got
