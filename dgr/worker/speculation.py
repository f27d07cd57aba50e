"""Speculative decoding on the last stage of a route (docs/speculative.md).

In the decode loop (``Forward.steps``) the last stage drafts the tokens it expects next and
sends ``[token, draft...]`` around the ring as one step (``Forward.drafts``). When that step
comes back, it samples every draft's row exactly as plain decoding would (``sample_rows``:
a token depends on its row and its position only), accepts the longest prefix of drafts that
matches, and the next step rolls the rest back on every stage (``Forward.rollback``).

What lives here, all of it the last stage's, keyed by session and epoch like its caches:

- ``accept``: the verification rule;
- ``NgramDrafter``: prompt-lookup drafts from the session's own tokens (the driver sends the
  last stage the token ids, prompt included, so it has them);
- ``MtpDrafter``: drafts from the engine's multi-token-prediction block (``Engine.mtp_draft``);
- ``DraftPolicy``: how many drafts pay, from the measured acceptance and the measured cost
  of a trip with more tokens (down to 0: plain decoding);
- ``Speculator``: the per-session state and the three calls the worker makes (``observe``
  when a step commits, ``draft`` before the loop step leaves, ``forget`` when the session
  table drops a session).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from dgr.errors import RollbackUnsupported
from dgr.protocol.wire import MAX_DRAFT

__all__ = ["accept", "NgramDrafter", "MtpDrafter", "DraftPolicy", "FixedDraftPolicy", "Rate",
           "Speculator", "SpecState", "SpecStats"]


def accept(drafts: Sequence[int], sampled: Sequence[int],
           stop_tokens: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Verify ``drafts`` against the tokens ``sampled`` from their rows.

    ``sampled[j]`` is the token sampled from the row of the token before draft ``j`` (so
    ``len(sampled) == len(drafts) + 1``). Draft ``j`` is accepted while every draft before it
    was and ``sampled[j] == drafts[j]``. Returns ``(emitted, accepted)``: the tokens the step
    makes (the accepted drafts, then the one sampled after them), cut after the first stop
    token, and the number of drafts accepted. With a deterministic drafter this makes exactly
    the tokens plain decoding would from the same rows.
    """
    a = 0
    k = len(drafts)
    while a < k and sampled[a] == drafts[a]:
        a += 1
    emitted = [int(t) for t in sampled[:a + 1]]
    if stop_tokens:
        stops = set(stop_tokens)
        for i, t in enumerate(emitted):
            if t in stops:
                emitted = emitted[:i + 1]
                break
    return emitted, a


class NgramDrafter:
    """Prompt-lookup drafts: the tokens that followed the last time the session's latest
    ``n`` tokens occurred, for the longest ``n`` in ``[n_min, n_max]`` that occurred before.

    An index maps every n-gram of the history to the position after its latest occurrence;
    ``extend`` and ``truncate`` keep it in step with the history, so a draft costs a few
    dictionary lookups, not a scan.
    """

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max

    def new_state(self) -> dict:
        # per n: n-gram -> end positions of its occurrences (latest last)
        return {n: {} for n in range(self.n_min, self.n_max + 1)}

    def extend(self, index: dict, history: list[int], start: int) -> None:
        """Index the n-grams that end at positions ``start..len(history)-1``."""
        for n, table in index.items():
            for end in range(max(start, n - 1), len(history)):
                key = tuple(history[end - n + 1:end + 1])
                table.setdefault(key, []).append(end + 1)

    def truncate(self, index: dict, history: list[int], keep: int) -> None:
        """Forget the n-grams that end at or after position ``keep`` (history is cut there)."""
        for n, table in index.items():
            # latest first: a key's entries are in position order, its latest last
            for end in range(len(history) - 1, max(keep, n - 1) - 1, -1):
                key = tuple(history[end - n + 1:end + 1])
                ends = table.get(key)
                if ends and ends[-1] == end + 1:
                    ends.pop()
                    if not ends:
                        del table[key]

    def draft(self, index: dict, history: list[int], token: int, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``history + [token]``."""
        return self.lookup(index, history, token, k)[0]

    def lookup(self, index: dict, history: list[int], token: int, k: int
               ) -> tuple[list[int], int]:
        """Up to ``k`` tokens to follow ``history + [token]``, and the size of the n-gram
        that matched (0: none did)."""
        if k <= 0:
            return [], 0
        ctx = history + [token]
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(ctx) < n + 1:
                continue
            key = tuple(ctx[-n:])
            ends = index[n].get(key)
            if not ends:
                continue
            # the latest occurrence (the token just sampled is not indexed, so every entry
            # is an earlier one): what followed it, up to the context's end
            at = ends[-1]
            return [int(t) for t in ctx[at:at + k]], n
        return [], 0


class MtpDrafter:
    """Drafts from the model's own multi-token-prediction (NextN) block, which the last
    stage's engine loads (``mtp=True``) and keeps in step with every step it computes; its
    state is the engine's, per slot (``Engine.mtp_draft``, ``Engine.truncate``).

    The block drafts from the trunk's hidden row of the last position kept, so the slot's
    rejected drafts are dropped first (``truncate`` to ``pos``; the next step's own rollback
    then finds nothing left to drop). ``owns(session, epoch, slot)`` says whether the slot is
    still the session's (the table may have released it meanwhile); ``drop(session)`` ends a
    session whose slot could not roll back (its next step is then refused, and re-prefilled).
    """

    def __init__(self, engine, owns, drop):
        self.engine, self.owns, self.drop = engine, owns, drop

    def draft(self, session: str, epoch: int, slot: int, pos: int, token: int,
              k: int) -> list[int]:
        """Up to ``k`` drafts after ``token``, which goes at ``pos`` of ``slot``."""
        if k <= 0:
            return []
        with self.engine.lock:  # no compute between the check, the truncate and the draft
            if not self.owns(session, epoch, slot):
                return []
            try:
                self.engine.truncate(slot, pos)
            except RollbackUnsupported:
                self.drop(session)
                return []
            return [int(t) for t in self.engine.mtp_draft(slot, token, k)]


class DraftPolicy:
    """How many drafts a trip should carry, from what the stage measured.

    A trip with ``k`` drafts makes ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens on average when
    each draft is accepted with probability ``a`` (given the ones before it were), and costs
    ``T(k) = T0 * (1 + beta * k)``: the ring's time per trip grows with the step's tokens.
    The policy picks the ``k`` in ``[0, k_max]`` that maximizes ``E(k) / T(k)``.

    ``a`` is the stage's, per source of drafts (``Rate``: the n-gram size that matched, or
    MTP) and per position ``i`` of a trip's drafts (the chance draft ``i`` is accepted when
    the ones before it were, so ``E(k) = 1 + sum_j prod_(i<j) a_i``: acceptance comes in
    runs): accepted drafts over drafts tried, decayed, with a prior that pulls it back up
    while a source finds matches but is not drafted from (so a source that stopped paying is
    tried again after a while). ``beta`` is the stage's too: fitted from the trips it timed
    (the time from one of a session's loop steps reaching this stage to the next), by least
    squares over the recent ones (a trip's ``k``: the drafts each stage computed in it,
    averaged); ``beta_prior`` until they span more than one ``k``. A
    ``k`` above 0 must promise ``margin`` (10%) more tokens per second than plain decoding:
    a draft that is rejected costs its row's compute on every stage.
    """

    def __init__(self, beta_prior: float = 0.1, window: int = 256, prior: float = 0.5,
                 prior_weight: float = 2.0, decay: float = 0.95, explore: float = 0.99,
                 margin: float = 0.10):
        self.beta_prior = beta_prior
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        #: the decay of a source's counts each time it matched but was not drafted from
        #: (slower than ``decay``: a source judged bad is tried again after many matches)
        self.explore = explore
        self.margin = margin
        self._trips: collections.deque = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._beta: float | None = None
        self._stale = 0  # trips since ``beta`` was fitted (refitted every ``REFIT`` trips)

    #: trips between two fits of ``beta`` (a fit is a pass over ``window`` trips)
    REFIT = 16

    def trip(self, k: float, seconds: float) -> None:
        """One trip of ``k`` drafts took ``seconds`` (loop step to loop step; ``k`` is the
        mean over the stages it crossed)."""
        with self._lock:
            self._trips.append((k, seconds))
            self._stale += 1
            if self._beta is not None and (self._stale >= self.REFIT or len(self._trips) < 32):
                self._beta = None

    @property
    def beta(self) -> float:
        """The fitted relative cost of one more draft in a trip (``beta_prior`` until fitted)."""
        with self._lock:
            if self._beta is None:
                self._beta, self._stale = self._fit(), 0
            return self._beta

    def _fit(self) -> float:
        trips = list(self._trips)
        if len(trips) < 8:
            return self.beta_prior
        ks = [k for k, _ in trips]
        n = len(trips)
        mk = sum(ks) / n
        var = sum((k - mk) ** 2 for k in ks)
        if var < 1e-9:
            return self.beta_prior
        mt = sum(t for _, t in trips) / n
        slope = sum((k - mk) * (t - mt) for k, t in trips) / var
        t0 = mt - slope * mk
        if t0 <= 0:
            return self.beta_prior
        return max(slope / t0, 0.0)

    def rates(self, r: Rate, n: int):
        """The estimated acceptance of a source's drafts ``0..n-1``, each given the ones
        before it were accepted (a position never tried takes the one before it: acceptance
        comes in runs, a copied passage goes on)."""
        w = self.prior_weight
        a = self.prior
        for j in range(min(n, len(r.tried))):
            if j == 0 or r.tried[j] > 0.05:
                a = (r.accepted[j] + a * w) / (r.tried[j] + w)
            yield a

    def rate(self, r: Rate, i: int = 0) -> float:
        """The estimated acceptance of a source's draft ``i`` (``rates``)."""
        a = self.prior
        for a in self.rates(r, i + 1):
            pass
        return a

    def choose(self, r: Rate, k_max: int) -> int:
        """Drafts for a trip from source ``r`` (0: plain decoding pays best)."""
        if k_max <= 0:
            return 0
        beta = self.beta
        best_k, best = 0, 1.0 + self.margin
        e, p = 1.0, 1.0
        for k, a in enumerate(self.rates(r, k_max), 1):
            p *= min(a, 0.999)  # every draft up to k accepted
            e += p
            v = e / (1.0 + beta * k)
            if v > best + 1e-9:
                best_k, best = k, v
        return best_k

    def update(self, r: Rate, drafted: int, accepted: int) -> None:
        """A trip verified ``drafted`` drafts of source ``r``, ``accepted`` of them; with
        none (the source matched but was not drafted from), what it measured decays toward
        the prior."""
        with self._lock:
            f = self.decay if drafted else self.explore
            for j in range(len(r.tried)):
                r.accepted[j] *= f
                r.tried[j] *= f
            # draft j was tried when every one before it was accepted
            for j in range(min(drafted, accepted + 1)):
                r.tried[j] += 1
                r.accepted[j] += j < accepted


class FixedDraftPolicy(DraftPolicy):
    """Always as many drafts as allowed (``k_max``): a schedule that depends on the tokens
    only, never on timing, for comparing routes under the same speculative schedule (tests,
    benchmarks of the drafts' cost)."""

    def choose(self, r: Rate, k_max: int) -> int:
        return max(k_max, 0)


@dataclass
class Rate:
    """How often the drafts of one source were accepted, per position in a trip's drafts
    (decayed counts: draft ``j`` tried, and accepted, given the ones before it were)."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)
    tried: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)


@dataclass
class SpecState:
    """One session's speculation on the last stage (under one epoch)."""

    epoch: int
    history: list[int] = field(default_factory=list)  # tokens at positions 0..len-1
    index: Any = None  # the n-gram drafter's index of ``history``
    ok: bool = True  # False once a step came without token ids: no drafting this epoch
    last_arrive: float = 0.0  # when the session's last loop step reached this stage
    last_k: int = -1  # the drafts it carried (-1: not a loop step)
    source: Any = None  # the Rate of the source its drafts came from (None: no drafts)


@dataclass
class SpecStats:
    """What the stage's speculation did since it started (Describe counters)."""

    trips: int = 0  # loop steps verified here (with or without drafts)
    drafted: int = 0  # drafts sent around the ring
    accepted: int = 0  # drafts accepted
    emitted: int = 0  # tokens the verified trips made


class Speculator:
    """The last stage's speculation: per-session state, drafting, the policy, counters.

    Thread-safe: the stage's threads call it for different sessions at once (a session's own
    steps come one at a time).
    """

    def __init__(self, n_ctx: int, ngram: NgramDrafter | None = None,
                 mtp: MtpDrafter | None = None, policy: DraftPolicy | None = None,
                 max_rollback: int | None = None):
        self.n_ctx = n_ctx
        #: the most positions a step may roll back (the caches' window; None: any): a trip
        #: carries no more drafts than that
        self.max_rollback = max_rollback
        self.ngram = ngram or NgramDrafter()
        self.mtp = mtp
        self.policy = policy or DraftPolicy()
        self.stats = SpecStats()
        #: the acceptance of each source of drafts: an n-gram size, or "mtp"
        self.rates: dict[Any, Rate] = collections.defaultdict(Rate)
        self._states: dict[str, SpecState] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def forget(self, session: str) -> None:
        """The session table dropped (or re-epoched) ``session``: drop its state."""
        with self._lock:
            self._states.pop(session, None)

    def state(self, session: str) -> SpecState | None:
        with self._lock:
            return self._states.get(session)

    def observe(self, h, emitted: list[int] | None, accepted: int, t_arrive: float) -> None:
        """A step of ``h`` committed on this (last) stage: its input tokens up to the
        accepted drafts are now the session's history (``emitted``/``accepted``: what its
        verification made, when it carried drafts)."""
        toks = h.tokens
        with self._lock:
            st = self._states.get(h.session)
            if toks is None:  # not speculating, or a gap: nothing to draft from this epoch
                if st is not None:
                    st.ok = False
                    st.history, st.index = [], None
                return
            if st is None or st.epoch != h.epoch:
                if h.first_pos != 0 or not h.speculate:
                    # not speculating, or joined mid-epoch: nothing to draft from until the
                    # next epoch
                    if st is not None:
                        del self._states[h.session]
                    return
                st = self._states[h.session] = SpecState(h.epoch, index=self.ngram.new_state())
        p = h.first_pos
        if not st.ok:
            return
        if len(st.history) < p:
            st.ok = False  # the history has a gap
            st.history, st.index = [], None
            return
        keep = toks[:h.n_tokens - h.drafts + accepted]  # the input up to its accepted drafts
        if len(st.history) > p:
            self.ngram.truncate(st.index, st.history, p)
            del st.history[p:]
        st.history.extend(int(t) for t in keep)
        self.ngram.extend(st.index, st.history, p)
        if h.steps:  # a loop step: time the trip, score the drafts
            if st.last_k >= 0 and st.last_arrive:
                # the time since the session's last step arrived here: that step computed on
                # this stage (its drafts), then this one on every other stage (its drafts)
                n = max(len(h.loop or ()), 1)
                k = (st.last_k + (n - 1) * h.drafts) / n
                self.policy.trip(k, t_arrive - st.last_arrive)
            st.last_arrive, st.last_k = t_arrive, h.drafts
            if h.drafts and st.source is not None:
                self.policy.update(st.source, h.drafts, accepted)
            st.source = None
            with self._lock:
                s = self.stats
                s.trips += 1
                s.drafted += h.drafts
                s.accepted += accepted
                s.emitted += len(emitted or ())

    def draft(self, h, slot: int, token: int, left: int) -> list[int]:
        """Drafts to send after ``token`` in the loop step following ``h`` (``left``: tokens
        the loop still makes, ``token`` included; none past the context)."""
        st = self.state(h.session)
        if st is None or not st.ok or st.epoch != h.epoch or not h.speculate:
            return []
        pos = len(st.history)  # where ``token`` goes
        k_max = min(h.max_draft, left - 1, self.n_ctx - pos - 1)
        if self.max_rollback is not None:
            k_max = min(k_max, self.max_rollback)
        if k_max <= 0:
            return []
        if h.speculate == "mtp":
            if self.mtp is None:
                return []
            rate = self.rates["mtp"]
            k = self.policy.choose(rate, k_max)
            if k <= 0:
                self.policy.update(rate, 0, 0)
                return []
            out = self.mtp.draft(h.session, h.epoch, slot, pos, token, k)
        else:
            out, n = self.ngram.lookup(st.index, st.history, token, k_max)
            if not out:
                return []
            rate = self.rates[n]
            k = self.policy.choose(rate, len(out))
            if k <= 0:
                self.policy.update(rate, 0, 0)
                return []
            out = out[:k]
        st.source = rate if out else None
        return out
