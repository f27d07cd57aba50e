"""The last stage's record of each session's tokens: what the penalties count.

A route's driver sends the token ids of every step to the last stage (``Hop.tokens``), so
the last stage sees the whole sequence go by, the prompt included, as llama-server's sampler
is fed it. ``Histories`` keeps it per session and epoch, cut back where a step starts (a
rollback of rejected drafts, a re-prefill) and extended by what each step committed. A row
sampled with penalties gets the tokens before its own (``window``); a step whose session has
a gap here (it joined mid-epoch, or a step came without token ids) is refused rather than
sampled without them.
"""

from __future__ import annotations

import array
import threading
from typing import Sequence

from dgr import errors

__all__ = ["Histories"]


class Histories:
    """Per session (under its epoch): the token ids at positions 0, 1, ... committed here.

    Thread-safe: the stage's threads call it for different sessions at once (a session's own
    steps come one at a time).
    """

    def __init__(self):
        self._seqs: dict[str, tuple[int, array.array]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seqs)

    def forget(self, session: str) -> None:
        with self._lock:
            self._seqs.pop(session, None)

    def fork(self, session: str, epoch: int, into: str, into_epoch: int) -> None:
        """``into`` (at ``into_epoch``) starts with ``session``'s record (a forked session);
        nothing when ``session`` has none at ``epoch``."""
        with self._lock:
            got = self._seqs.get(session)
            if got is not None and got[0] == epoch:
                self._seqs[into] = (into_epoch, array.array("i", got[1]))

    def record(self, session: str) -> array.array | None:
        """A copy of the session's record (None: it has none)."""
        with self._lock:
            got = self._seqs.get(session)
        return None if got is None else array.array("i", got[1])

    def install(self, session: str, epoch: int, tokens: Sequence[int]) -> None:
        """``session`` (at ``epoch``) starts with ``tokens`` at positions 0, 1, ... (a
        session that adopted a kept prefix)."""
        with self._lock:
            self._seqs[session] = (epoch, array.array("i", tokens))

    def _seq(self, h) -> array.array | None:
        """The session's record, valid for step ``h`` (covering positions before
        ``h.first_pos``); a new one at position 0 of a new epoch; None: a gap."""
        with self._lock:
            got = self._seqs.get(h.session)
        if got is None or got[0] != h.epoch:
            return array.array("i") if h.first_pos == 0 else None
        return got[1] if len(got[1]) >= h.first_pos else None

    def windows(self, h, rows: Sequence[int], last_n: int) -> list[Sequence[int]]:
        """For each of ``rows`` of step ``h``: the last ``last_n`` tokens before the token
        that row samples (the row's own input token included)."""
        if h.tokens is None or (h.positions is not None and list(h.positions) != list(
                range(h.first_pos, h.first_pos + h.n_tokens))):
            raise errors.InvalidArgument(
                "penalties need the step's token ids at the last stage, in consecutive "
                "positions")
        seq = self._seq(h)
        if seq is None:
            raise errors.InvalidArgument(
                f"penalties need every token of session {h.session!r} from position 0 at the "
                f"last stage; it has a gap before position {h.first_pos}")
        p = h.first_pos
        before = list(seq[max(0, p - last_n):p]) if last_n else []
        return [(before + list(h.tokens[:r + 1]))[-last_n:] for r in rows]

    def span(self, h, a: int, b: int) -> list[int]:
        """The session's tokens at positions ``a`` .. ``b - 1`` as step ``h`` sees them (the
        record before its start, then its own token ids); shorter where they are not here."""
        p = h.first_pos
        seq = self._seq(h)
        out = [] if seq is None else [int(t) for t in seq[a:min(b, p)]]
        if b > p and h.tokens is not None and len(out) == max(0, min(b, p) - a):
            out += [int(t) for t in h.tokens[max(a, p) - p:b - p]]
        return out

    def commit(self, h, kept: int) -> None:
        """Step ``h`` committed its first ``kept`` tokens (all but its rejected drafts):
        the record is cut where it starts and extended by them."""
        seq = None if h.tokens is None else self._seq(h)
        if seq is None:  # no token ids, or a gap: no record from here
            self.forget(h.session)
            return
        del seq[h.first_pos:]
        seq.extend(int(t) for t in h.tokens[:kept])
        with self._lock:
            self._seqs[h.session] = (h.epoch, seq)
