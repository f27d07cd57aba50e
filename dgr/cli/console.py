"""What the commands tell their user on stderr (stdout stays the command's output)."""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(msg: str) -> None:
    """One ``[dgr]`` line on stderr, flushed."""
    print(f"[dgr] {msg}", file=sys.stderr, flush=True)
