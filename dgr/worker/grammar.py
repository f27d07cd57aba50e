"""The last stage's grammars: each constrained session's state (``dgr.protocol.grammar``).

A step whose ``Sampling.grammar_id`` is nonzero samples under that grammar. The first such
step of a session (under an epoch) brings the grammar's text; the stage keeps the session's
``Constraint`` and the text by id, so later steps (the decode loop's, which this stage
builds) name it by id alone. The state follows the session's positions: drafts consumed to
mask their rows are rolled back when rejected, and a re-prefill catches up from the tokens
the stage keeps (``dgr.worker.history``).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

import numpy as np

from dgr import errors
from dgr.protocol.grammar import Constraint, Vocabulary, grammar_id

__all__ = ["Grammars"]

#: grammar texts kept by id (the most recently used)
MAX_TEXTS = 64


class Grammars:
    """Per session: ``((epoch, grammar id, start), Constraint)``. Thread-safe across sessions (a
    session's own steps come one at a time)."""

    def __init__(self, engine: Any):
        self.vocab = Vocabulary(engine)
        self._states: dict[str, tuple[tuple[int, int, int], Constraint]] = {}
        self._texts: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def forget(self, session: str) -> None:
        with self._lock:
            self._states.pop(session, None)

    def constraint(self, h) -> Constraint | None:
        """The constraint of step ``h`` (None: it samples freely)."""
        s = h.sampling
        gid = getattr(s, "grammar_id", 0) if s is not None else 0
        if not gid:
            return None
        key = (h.epoch, gid, s.grammar_from)
        with self._lock:
            got = self._states.get(h.session)
            # a step from before the grammar's start is a prompt's (a new request on a kept
            # session, the prompt cache's): its reply starts a state of its own, never rolled
            # back from an earlier reply's
            if got is not None and got[0] == key and h.first_pos >= s.grammar_from:
                return got[1]
            text = s.grammar or self._texts.get(gid)
        if not text:
            raise errors.InvalidArgument(
                f"grammar {gid:016x} is not known on this stage: the step must bring its text")
        if s.grammar and grammar_id(s.grammar) != gid:
            raise errors.InvalidArgument("Sampling.grammar_id is not the id of its grammar")
        c = Constraint(self.vocab, text, s.grammar_from)
        with self._lock:
            self._states[h.session] = (key, c)
            self._texts[gid] = text
            self._texts.move_to_end(gid)
            while len(self._texts) > MAX_TEXTS:
                self._texts.popitem(last=False)
        return c

    def mask(self, h, logits: np.ndarray, rows: Sequence[int], history) -> np.ndarray:
        """``logits`` (one row per ``rows`` of step ``h``) with each row masked by the
        session's grammar in the state before the token it samples. Rows past a draft that
        does not fit the grammar are left as they are: they cannot be accepted."""
        c = self.constraint(h)
        if c is None:
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        for i, r in enumerate(rows):
            if not c.seek(h.first_pos + r + 1, lambda a, b: history.span(h, a, b)):
                break
            out[i] = c.mask(out[i])
        return out
