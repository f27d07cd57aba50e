"""``python -m dgr.testing.kill_after N ARGS...``: ``python -m dgr.artifacts ARGS...`` that
SIGKILLs itself right after its journal records the N-th verified chunk (or tensor), the
journal written first, as a crash there would leave it: how the resume tests stop a verifier
(``dgr.artifacts.verify.on_unit_done``)."""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from dgr.artifacts import verify
    from dgr.artifacts.cli import main as artifacts

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m dgr.testing.kill_after N ARGS... (N >= 1: the verified "
              "units after which the process SIGKILLs itself)", file=sys.stderr)
        return 2
    after, done = int(argv[0]), 0

    def unit_done(journal) -> None:
        nonlocal done
        done += 1
        if done >= after:
            journal.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    verify.on_unit_done = unit_done
    return artifacts(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
