"""Measuring concurrent sessions the way ``llama-batched-bench`` measures its sequences.

``llama-batched-bench`` reports ``S_TG``: its sequences' generated tokens over the time of the
generation phase alone, every sequence decoding in lockstep after one prompt batch. Output
tokens over a concurrent run's wall time counts, besides, every session's prefill and the
ramp up and down, so the two are not the same figure. ``decode_tps`` is the like-for-like
one: the tokens the sessions made while all of them were decoding, over that time.
``end_to_end_tps`` of a batched-bench record is the like-for-like figure of the other kind:
its generated tokens over its prompt and generation phases together.

``median_us`` times a call the way the micro benchmarks do. ``cpu_seconds`` and ``children``
read a process's CPU time and its child processes from ``/proc`` (a server and the workers it
started).
"""

from __future__ import annotations

import os
import statistics
import timeit
from collections.abc import Callable, Sequence

__all__ = ["decode_tps", "end_to_end_tps", "rate", "cpu_seconds", "cpu_of", "children",
           "median_us"]

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds, every thread) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15 of stat(5)


def cpu_of(pids) -> float:
    """The CPU seconds of ``pids``, summed."""
    return sum(cpu_seconds(p) for p in pids)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc/<pid>/stat's ppid), in pid order."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4 of stat(5)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if ppid == pid:
            out.append(int(name))
    return sorted(out)


def decode_tps(token_times: Sequence[Sequence[float]]) -> float | None:
    """Output tokens/s while every session decoded (``S_TG``'s counterpart).

    ``token_times``: per session, its tokens' arrival times (``Generation.token_times``).
    The window runs from the last session's first token (every session has prefilled) to
    the first session's last token (none has finished); the tokens that arrived inside it
    (after its start, up to its end) count. One session: its tokens after the first over its
    decode time. None when there is no such window (a session of one token, or sessions
    that never decoded at the same time)."""
    runs = [list(t) for t in token_times]
    if not runs or any(len(t) < 2 for t in runs):
        return None
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    if end <= start:
        return None
    n = sum(1 for t in runs for x in t if start < x <= end)
    return n / (end - start)


def rate(m: dict) -> float:
    """A concurrent-session measurement's tokens/s to set against S_TG: its ``decode_tps``,
    or, in results from before token times (or without a decode window), its
    ``aggregate_tps`` (output tokens over the wall time)."""
    return m.get("decode_tps") or m["aggregate_tps"]


def end_to_end_tps(record: dict) -> float:
    """A ``llama-batched-bench`` jsonl record's generated tokens over its prompt and
    generation phases together (dgr's output tokens over the wall time, counterpart)."""
    return int(record["pl"]) * int(record["tg"]) / (float(record["t_pp"]) + float(record["t_tg"]))


def median_us(fn: Callable[[], object], number: int = 50, repeat: int = 400) -> float:
    """Microseconds per call of ``fn``: the median of ``repeat`` batches of ``number`` calls
    (short batches: one the scheduler preempts on a shared machine is an outlier the median
    ignores, instead of inflating every long batch a little)."""
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6
