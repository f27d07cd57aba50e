"""asv benchmarks of the last stage's per-trip speculation work (dgr.worker.speculation): what
a trip adds on the last stage besides compute, as a session's history grows.

- ``time_observe_and_draft``: one decode-loop trip's bookkeeping: ``Speculator.observe`` of a
  verified step (history, n-gram index, rollback of the rejected tail, the policy's counts)
  and ``Speculator.draft`` of the next step's drafts;
- ``time_accept``: the verification of ``k`` drafts against their rows' tokens.

The compute of the trip's rows is the engine's (``bench_engine``); the trip's cost against
speculation off is ``benches/speculative.py``.
"""

from __future__ import annotations

import numpy as np

from dgr.protocol import wire
from dgr.worker.speculation import Speculator, accept

HISTORY = [64, 1024, 4096]
SEED = 0


def _step(pos: int, toks: list[int], drafts: int) -> wire.Forward:
    return wire.Forward(model="bench", session="s", epoch=1, first_pos=pos,
                        n_tokens=len(toks), layer=0, tokens=toks, want="token", drafts=drafts,
                        steps=64, speculate="ngram", max_draft=8,
                        loop=[wire.Hop(endpoint="a:1")] * 3, reply_to="r")


class Speculation:
    params = HISTORY
    param_names = ["history"]

    def setup(self, history: int):
        rng = np.random.default_rng(SEED)
        # repeated phrases, so the index has matches: 16-token phrases from a 40-phrase set
        phrases = rng.integers(100, 49152, size=(40, 16))
        toks = [int(t) for t in phrases[rng.integers(0, 40, size=history // 16 + 1)].ravel()]
        self.sp = Speculator(n_ctx=history + 64)
        self.sp.observe(_step(0, toks[:history], 0), None, 0, 0.0)
        self.pos = history
        self.next = toks[history - 16:history - 8]  # a phrase seen before: drafts exist
        self.t = 0.0

    def time_observe_and_draft(self, history: int):
        # a trip of [t, d1..d4] with two drafts accepted, then the next step's drafts
        p = self.pos
        step = _step(p, self.next[:5], 4)
        self.t += 0.05
        self.sp.observe(step, self.next[1:4], 2, self.t)
        self.sp.draft(step, 0, self.next[3], 32)
        # undo: the next call sees the same history
        st = self.sp.state("s")
        self.sp.ngram.truncate(st.index, st.history, p)
        del st.history[p:]

    def time_accept(self, history: int):
        accept([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 0, 0, 0, 0], [2**20])
