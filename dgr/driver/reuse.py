"""Which of a route session's positions a later prompt may keep, with the bits a fresh
prefill of it gives (``ReuseRules.reusable``): the rules over a session's steps and prompt
chunks, from what every stage measured of its rows (``prefix_rows_exact``,
``prefix_single_rows_exact``, ``prefix_chunk_rows_exact``), its recurrent state snapshots, and
its media steps (docs/serve.md "Prompt cache", docs/media.md)."""

from __future__ import annotations

from typing import Sequence

from dgr.driver.media import MediaKey

__all__ = ["ReuseRules"]


class ReuseRules:
    """The reuse rules of ``dgr.driver.session.AsyncRouteSession``, over its ``route``,
    ``history``, ``steps``, ``chunks``, ``snapshots`` and ``media``."""

    def aligned(self) -> int:
        """How many of ``history``'s first tokens were prefilled in the chunks a fresh
        prefill makes (whole ``n_ubatch`` chunks from position 0): the part another prompt
        may reuse with the bits a fresh prefill gives (``generate``'s ``reuse``)."""
        ub, n = self.route.n_ubatch, 0
        for first, count in self.steps:
            if first != n or count != ub:
                break
            n += ub
        return n

    def recurrent(self) -> bool:
        """Whether a stage of the route rolls nothing back (``rollback_window`` 0: a recurrent
        or hybrid model): its state keeps no history, so it goes back only to a snapshot."""
        return any(getattr(st, "rollback_window", -1) == 0 for st in self.route.stages)

    def route_snapshots(self) -> int:
        """How many state snapshots every stage of a recurrent route keeps per session (the
        fewest any keeps; 0 on another route: none needed)."""
        if not self.recurrent():
            return 0
        return min(int(getattr(st, "state_snapshots", 0)) for st in self.route.stages)

    def reuses(self) -> bool:
        """Whether a later prompt may reuse any of this session's positions: on a recurrent
        route only where every stage keeps state snapshots (``route_snapshots``), and then
        only at one of them (``reusable``)."""
        return not self.recurrent() or self.route_snapshots() > 0

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many of this session's positions a later ``prompt`` may keep (``generate``'s
        ``reuse``) and still get the bits a fresh prefill of it gives; 0 for none.

        A fresh prefill runs whole ``n_ubatch`` chunks from position 0, then one partial
        chunk. The kept positions are the common prefix of ``history`` and ``prompt``
        (leaving at least one prompt token, the step that samples), cut to the whole chunks
        this session prefilled from 0 (``aligned``). Past the prompt's own whole chunks they
        may go on into rows this session prefilled in partial chunks of two rows or more, when
        every stage computes such rows as any partial chunk does (``prefix_rows_exact``,
        measured by each worker): then the prompt's rest is prefilled as a partial chunk of
        at least two rows, and a kept chunk cut short keeps at least two rows (a single row
        may take another kernel). When every stage also computes rows one per step as a
        partial chunk does (``prefix_single_rows_exact``), the kept rows may be any steps'
        (a reply's decode steps included: a chat's next turn holds them), and the rest may be
        one row; else decode steps' rows are never kept past whole chunks. Where every
        stage computes a prompt's rows alike however it was cut into chunks of two rows or
        more (``_chunk_rule``), every prompt row it shares, whole chunks or not (the rest is
        prefilled up to the next multiple of ``n_ubatch``, then in a fresh prefill's chunks:
        an agent's next turn keeps its last prompt's tail). Where every stage computes any
        cut of a prompt alike (``_any_rows``), every row it shares, decode steps' too. None
        on a route with a stage that rolls nothing back (``rollback_window`` 0: a recurrent or
        hybrid model) but at a state snapshot every stage keeps (``snapshots``): the state at
        the end of a whole chunk prefilled from 0 is a fresh prefill's there, bit for bit
        (tests/integration/test_hybrid_splits.py), and rows past it are not (a recurrent
        state after a partial chunk or decode steps is computed by other kernels)."""
        if not self.reuses():
            return 0
        ub, n = self.route.n_ubatch, len(prompt)
        common = 0
        for a, b in zip(self.history, prompt):
            if a != b:
                break
            common += 1
        common = min(common, n - 1)
        if self.recurrent():
            return max((p for p in self.snapshots if p <= common), default=0)
        if self.media or any(isinstance(k, MediaKey) for k in prompt):
            return self._media_rows(prompt, common)
        if self._any_rows():
            return min(common, self._computed())
        aligned = self.aligned()
        base = max(0, min(common, aligned))
        base -= base % ub
        if self._chunk_rule():
            return max(base, self._prompt_rows(min(common, self._chunks_end()), prompt))
        full = n - n % ub  # where a fresh prefill of ``prompt`` ends its whole chunks
        rows, single, least = self._row_rule()
        if common <= full or aligned < full or not rows:
            return base
        end = self._rows_end(full, single, least)
        p = min(common, end, n - least)  # the prompt's rest: a partial chunk of ``least`` rows
        if not single:
            for first, count in self.chunks:
                if p - first == 1 and count > 1:  # a kept chunk cut to one row: drop it
                    p = first
        return p if p > full else base

    def _media_rows(self, prompt: Sequence, common: int) -> int:
        """``reusable`` of a prompt or session with media steps: the common prefix where
        every stage computes a prompt's rows alike however it was cut (``_chunk_rule``; a
        media step is one step in any prefill, its rows a function of its media and position),
        else whole chunks from position 0 (``aligned``); never inside a media step."""
        ub = self.route.n_ubatch
        if self._chunk_rule():
            p = self._prompt_rows(min(common, self._chunks_end()), prompt)
        else:
            p = min(common, self.aligned())
            p -= p % ub
        for first, m in self.media.items():
            if first < p < first + m.span:
                p = first
        return p

    def _row_rule(self) -> tuple[bool, bool, int]:
        """What of this route's rows past whole chunks a later prompt may keep
        (``reusable``): ``(rows, single, least)``: rows of partial prompt chunks at all
        (every stage measured ``prefix_rows_exact``); rows of decode steps too (every stage
        measured ``prefix_single_rows_exact``); the fewest rows a kept step, or a prompt's
        rest, may have."""
        r, stages = self.route, self.route.stages
        rows = all(st.prefix_rows_exact for st in stages)
        # a decode loop's verify step (a drafted token and its drafts) must also be a partial
        # chunk: one of ``n_ubatch`` rows or more may take other kernels
        single = rows and (
            all(getattr(st, "prefix_single_rows_exact", False) for st in stages)
            and (not getattr(r, "speculate", "") or getattr(r, "max_draft", 0) + 1 < r.n_ubatch))
        return rows, single, 1 if single else 2

    def _any_rows(self) -> bool:
        """Whether a row's bits on this route do not depend on how its prompt was cut into
        steps: every stage measured a whole chunk's rows, partial chunks' rows and rows one per
        step alike (``prefix_chunk_rows_exact`` with ``_row_rule``'s; on the CPU only with
        ``dgr.Engine(batch_invariant=True)``). Then a later prompt keeps every row it shares
        (``reusable``), and the prefix stores name rows one key per position from 0."""
        _, single, _ = self._row_rule()
        return single and self._chunk_rule()

    def _chunk_rule(self) -> bool:
        """Whether a prompt row's bits on this route do not depend on how its prompt was cut
        into chunks of two rows or more: every stage measured partial chunks' rows alike
        (``prefix_rows_exact``) and a whole chunk's rows alike theirs
        (``prefix_chunk_rows_exact``; on the CPU since patch 0026, often with ggml's own
        kernels). Then a later prompt keeps every prompt row it shares (``reusable``), but not
        a decode step's unless ``_any_rows``."""
        return all(getattr(st, "prefix_rows_exact", False)
                   and getattr(st, "prefix_chunk_rows_exact", False) for st in self.route.stages)

    def _chunks_end(self) -> int:
        """The end of the run of prompt chunks of two rows or more from position 0 (the
        rows ``_chunk_rule`` lets a later prompt keep: a one-row chunk's may take another
        kernel, a decode step's are never prompt rows)."""
        end = 0
        for first, count in self.chunks:
            if first != end or count < 2:
                break
            end = first + count
        return end

    def _prompt_rows(self, p: int, prompt: Sequence) -> int:
        """``p`` kept positions of ``prompt`` (its keys) under ``_chunk_rule``, cut back so
        that neither a kept chunk (recovery replays it as one step) nor the rest's first chunk
        (``prefill(align=True)``: up to the next multiple of ``n_ubatch``, or the end of the
        prompt's run of text there) is one row, which may take another kernel (a fresh
        prefill's own one-row chunk, a last one at a multiple of ``n_ubatch`` or a run of
        text's first, is the same step either way)."""
        ub = self.route.n_ubatch
        while p > 0:
            own = not p % ub or isinstance(prompt[p - 1], MediaKey)  # a fresh prefill's cut
            q = p - 1 if not own and min(_text_end(prompt, p), p + -p % ub) - p == 1 else p
            for first, count in self.chunks:
                if q - first == 1 and count > 1:  # a kept chunk cut to one row: drop it
                    q = first
            if q == p:
                return p
            p = q
        return 0

    def _computed(self) -> int:
        """How many of ``history``'s first positions every stage's cache holds (its steps')."""
        return self.steps[-1][0] + self.steps[-1][1] if self.steps else 0

    def _rows_end(self, start: int, single: bool, least: int) -> int:
        """The end of the run of this session's steps from position ``start`` whose rows a
        later prompt may keep: partial steps of ``least`` to ``n_ubatch - 1`` rows, prompt
        chunks only unless ``single``."""
        ub, end = self.route.n_ubatch, start
        for first, count in self.steps if single else self.chunks:
            if first + count <= start:
                continue
            if first != end or not least <= count < ub:
                break
            end = first + count
        return end


def _text_end(prompt: Sequence, p: int) -> int:
    """Where the run of text positions of ``prompt`` (keys) that holds ``p`` ends: at its
    next media position, or its end."""
    return next((q for q in range(p, len(prompt)) if isinstance(prompt[q], MediaKey)),
                len(prompt))
