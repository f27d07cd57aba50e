"""Signals of the long-running commands (run, generate, serve)."""

from __future__ import annotations

import signal

__all__ = ["install_interrupts"]


def install_interrupts() -> None:
    """Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt, so the cleanup runs.

    SIGINT gets Python's default handler back even when this process inherited it ignored:
    a non-interactive shell starts background commands with SIGINT ignored, and Python then
    installs no handler of its own, so Ctrl-C would not stop a generation.
    """
    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)
