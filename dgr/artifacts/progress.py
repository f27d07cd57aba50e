"""The byte progress bar of long artifact work (manifest, verify, slice), drawn by tqdm."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]

_MIB = 1 / 2**20
# bytes done/total in MiB, the share done, the mean rate since the start, what is being read
_STATS = "{n:9.1f}/{total:.1f} MiB {percentage:5.1f}% {rate_noinv_fmt}{postfix}"
_TTY_FORMAT = "{desc} |{bar:28}| " + _STATS
_LINE_FORMAT = "{desc} " + _STATS


class Progress:
    """A byte progress bar on stderr, or nothing when not ``enabled``.

    On a terminal a tqdm bar redrawn in place (at most every 0.1 s, and once at the end);
    otherwise (a pipe, a log) one line each time another tenth of ``total`` is done. Each shows
    the MiB done and in all, the percentage, the mean rate since the start (MiB/s) and the
    label of the last update (a file or tensor name).
    """

    def __init__(self, total: int, what: str, enabled: bool):
        self.total, self.what, self.enabled = max(total, 1), what, enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self.last_decile = -1
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=f"[{what}]", bar_format=_TTY_FORMAT,
                            unit=" MiB", unit_scale=_MIB, smoothing=0, mininterval=0.1,
                            file=sys.stderr, leave=True)

    def update(self, n: int, label: str = "") -> None:
        """Count ``n`` more bytes done, the last of them from ``label``."""
        step = min(n, self.total - self.done)  # tqdm drops the total once it is overrun
        self.done += step
        if self.bar is not None:
            self.bar.set_postfix_str(label[:40], refresh=False)
            self.bar.update(step)
        elif self.enabled and int(self.done / self.total * 10) > self.last_decile:
            from tqdm import tqdm

            self.last_decile = int(self.done / self.total * 10)
            line = tqdm.format_meter(self.done, self.total, time.perf_counter() - self.t0,
                                     prefix=f"[{self.what}]", unit=" MiB", unit_scale=_MIB,
                                     bar_format=_LINE_FORMAT, postfix=label)
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
