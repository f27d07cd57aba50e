"""Whether a prompt's rows computed in one partial prefill chunk are the rows any other partial
chunk computes at those positions, measured on one stage's engine (the worker's
``Describe.prefix_rows_exact``; docs/serve.md "Prompt cache").

A fresh prefill of ``n`` tokens runs chunks of ``n_ubatch`` from position 0: whole chunks,
then one partial chunk of the ``n % n_ubatch`` tokens left. A kept session's cache may serve a
later prompt past its whole chunks only where the rows it holds there are the rows the later
prompt's own partial chunk would compute: the same bits although they came from a chunk of
another length (the earlier prompt's), and although the later prompt's tail is prefilled as a
chunk of its own. Whether that holds is the kernels' business (on the CPU, matrix products
may switch kernels by batch size; ggml's flash attention took another path for a chunk of
at least 64 rows than for fewer until patch 0026), so it is measured on the stage's engine,
never assumed:
``rows_exact`` computes ``n_ubatch - 1`` rows as one chunk and as two chunks split at several
points, and compares every row's output bit for bit (boundary rows, or logits on the last
stage). Every check runs from position 0 and again ``FAR`` positions in, since kernels may
also switch with the KV's length (ggml's CPU flash attention splits a lone single-row step's
KV of 512 cells or more over the threads: measured on SmolLM2 with two threads, decode rows
alike a chunk's at position 100 differ at 300 and on). ``single_rows_exact`` compares rows
computed one per step (a reply's), ``chunk_rows_exact`` a whole chunk's rows (on the CPU
alike only with ``dgr.Engine(batch_invariant=True)`` before patch 0026; since, often with
ggml's own kernels too, as on the tiny q8_0 llama: measured, never assumed). A route reuses
rows only when every stage says so (``dgr.driver.session.AsyncRouteSession.reusable``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import numpy as np

from dgr.artifacts.storage import read_json, update_json
from dgr.vendor import cache_root

__all__ = ["FAR", "far_start", "rows_exact", "rows_exact_cached", "single_rows_exact",
           "single_rows_exact_cached", "chunk_rows_exact", "chunk_rows_exact_cached"]

log = logging.getLogger("dgr.control.prefix")


#: How far into the context every check computes its rows a second time (or the last whole
#: chunk start that leaves room): kernels may switch with the KV's length too (ggml's CPU flash
#: attention splits a lone single-row step's KV of 512 cells or more over the threads), so rows
#: alike at the start of a context are not assumed alike further on.
FAR = 1024


def far_start(n_ctx: int, n_ubatch: int, rows: int) -> int:
    """Where a check computes ``rows`` rows a second time: ``FAR``, or the last whole chunk
    start that leaves them room in ``n_ctx``; 0 (no second start) when that is under
    ``FAR // 2``: a context that short never holds the KV lengths the second start is for
    (ggml's CPU split KV starts at 512 cells), and the checks stay cheap on it."""
    far = min(FAR, n_ctx - rows)
    far -= far % max(n_ubatch, 1)
    return far if far >= FAR // 2 else 0


def _n_ctx(engine) -> int:
    """The context tokens per slot the engine holds (``Engine.n_ctx``: as set, or as chosen
    for ``n_ctx=0``)."""
    return int(getattr(engine, "n_ctx", 0) or engine.settings["n_ctx"])


def _out(engine, slot: int, tokens, boundary, a: int, b: int, logits: str = "all"
         ) -> np.ndarray:
    kw = {}
    if tokens is not None:
        kw["tokens"] = tokens[a:b]
    if boundary is not None:
        kw["boundary"] = boundary[a:b]
    if engine.is_last:
        kw["logits"] = logits
    return np.array(engine.forward(slot, a, **kw), copy=True)


def _probe(engine, seed: int, n: int):
    """The checks' input for ``n`` rows computed from position 0 and from ``far``
    (``far_start``; 0: none): seeded token ids where the range takes
    them and a random boundary where it does not start the model; (far, tokens, boundary)."""
    far = far_start(_n_ctx(engine), int(engine.settings["n_ubatch"]), n)
    rng = np.random.default_rng(seed)
    tokens = boundary = None
    if engine.is_first or engine.needs_token_ids:
        lo = 100 if engine.n_vocab > 1000 else 0
        tokens = rng.integers(lo, engine.n_vocab, size=far + n, dtype=np.int32)
    if not engine.is_first:
        boundary = rng.standard_normal((far + n, int(engine.n_embd_boundary)),
                                       dtype=np.float32)
    return far, tokens, boundary


def _rows(engine, slot: int, start: int, tokens, boundary, sizes) -> np.ndarray:
    """The rows of positions ``[start, start + sum(sizes))`` computed as consecutive steps of
    ``sizes`` rows, after positions ``[0, start)`` (whole chunks, computed once per slot and
    start: later calls cut the slot back to ``start``, or prefill again where a cache cannot
    be cut)."""
    ub = int(engine.settings["n_ubatch"])
    kept = start > 0 and engine.next_pos(slot) >= start
    if kept:
        try:
            engine.truncate(slot, start)
        except Exception:  # noqa: BLE001 - a cache that cannot drop a tail: prefill again
            kept = False
    if not kept:
        engine.release(slot)
        for a in range(0, start, ub):
            _out(engine, slot, tokens, boundary, a, min(a + ub, start), "last")
    out, a = [], start
    for c in sizes:
        out.append(_out(engine, slot, tokens, boundary, a, a + c))
        a += c
    return np.concatenate(out)


def _alike(engine, seed: int, n: int, variants, slot: int) -> bool:
    """Whether ``n`` rows computed as one step equal them computed as each of ``variants``
    (lists of step sizes summing to ``n``), bit for bit, from position 0 and from ``far``.
    ``slot`` is released before and after."""
    far, tokens, boundary = _probe(engine, seed, n)
    try:
        for start in sorted({0, far}):
            engine.release(slot)
            whole = _rows(engine, slot, start, tokens, boundary, [n])
            for sizes in variants:
                got = _rows(engine, slot, start, tokens, boundary, sizes)
                if got.shape != whole.shape or got.tobytes() != whole.tobytes():
                    return False
        return True
    finally:
        engine.release(slot)


def rows_exact(engine, *, slot: int = 0, seed: int = 7) -> bool:
    """Whether ``engine`` (any layer range) computes a partial chunk's rows as another
    partial chunk does: ``n_ubatch - 1`` rows (at most 255) once as one chunk and as two
    chunks split in the middle and two rows before the end, every row compared bit for bit,
    from position 0 and again ``FAR`` positions in. ``slot`` is released before and after.
    False when ``n_ubatch`` is below 4 (no two partial chunks of two rows or more) or the
    engine cannot run the check."""
    n = min(int(engine.settings["n_ubatch"]) - 1, 255, _n_ctx(engine))
    if n < 3:
        return False
    splits = sorted({max(2, n // 2), n - 2} - {0, n})
    return _alike(engine, seed, n, [[s, n - s] for s in splits], slot)


def single_rows_exact(engine, *, slot: int = 0, seed: int = 11) -> bool:
    """Whether ``engine`` computes rows one per step (a decode step's row) as a partial chunk
    computes them: ``n_ubatch - 1`` rows (at most 255) once as one chunk, then as single-row
    steps, and as a chunk of the first half then single-row steps, every row compared bit for
    bit, from position 0 and again ``FAR`` positions in. Then a reply's decoded rows may serve
    a later prompt that holds the reply, past its whole chunks
    (``Describe.prefix_single_rows_exact``). ``slot`` is released before and after; False when
    ``n_ubatch`` is below 4."""
    n = min(int(engine.settings["n_ubatch"]) - 1, 255, _n_ctx(engine))
    if n < 3:
        return False
    return _alike(engine, seed, n, [[1] * n, [n // 2] + [1] * (n - n // 2)], slot)


def chunk_rows_exact(engine, *, slot: int = 0, seed: int = 13) -> bool:
    """Whether ``engine`` computes a whole ``n_ubatch`` chunk's rows as partial chunks compute
    them: one whole chunk (at most 256 rows) against two partial chunks split in the middle
    and two rows before the end, from position 0 and again ``FAR`` positions in. Together with
    ``single_rows_exact`` this says that a row's bits do not depend on how its prompt was cut
    into steps (``dgr.Engine(batch_invariant=True)``), so a later prompt may keep every row of
    an earlier one (``Describe.prefix_chunk_rows_exact``). False when ``n_ubatch`` is below 4
    or above 256."""
    n = int(engine.settings["n_ubatch"])
    if n < 4 or n > 256 or n > _n_ctx(engine):
        return False
    return _alike(engine, seed, n, [[n // 2, n - n // 2], [n - 2, 2]], slot)


def _key(engine) -> str:
    from dgr.control.capability import build_info, cpu_features

    info = engine.describe()
    # "far": the checks since they also measure FAR positions in (earlier entries measured
    # only from position 0, and said alike where a long context is not)
    facts = ["far", FAR, build_info(), info["identity"], list(engine.layers),
             dict(engine.settings), _n_ctx(engine),
             getattr(engine, "compute", "cpu"), list(cpu_features()[2])]
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def rows_exact_cached(engine, *, slot: int = 0) -> bool:
    """``rows_exact``, remembered under ``$DGR_CACHE/prefix-rows.json`` by everything that
    decides it (the build, the model, the range, the settings, the device kind, the CPU's
    kernel-selecting ISA flags): a worker measures once per stage it serves, not per start."""
    return _cached(engine, "", rows_exact, slot)


def single_rows_exact_cached(engine, *, slot: int = 0) -> bool:
    """``single_rows_exact``, remembered as ``rows_exact_cached`` is."""
    return _cached(engine, ":single", single_rows_exact, slot)


def chunk_rows_exact_cached(engine, *, slot: int = 0) -> bool:
    """``chunk_rows_exact``, remembered as ``rows_exact_cached`` is."""
    return _cached(engine, ":chunk", chunk_rows_exact, slot)


def _cached(engine, suffix: str, measure, slot: int) -> bool:
    path = cache_root() / "prefix-rows.json"
    try:
        key = _key(engine) + suffix
    except Exception:  # noqa: BLE001 - an engine without a build or identity: not measured
        return False
    known = read_json(path).get(key)
    if isinstance(known, bool):
        return known
    log.info("measuring whether layers [%d, %d) compute a prompt's rows alike however it is "
             "cut into steps (%s; once for this build, model, range and settings: "
             "remembered in %s)", *engine.layers, measure.__name__, path)
    t0 = time.monotonic()
    try:
        exact = measure(engine, slot=slot)
    except Exception:  # noqa: BLE001 - an engine that cannot run the check reuses whole chunks
        return False
    log.info("%s: %s (%.1f s)", measure.__name__, "yes" if exact else "no",
             time.monotonic() - t0)
    try:  # other processes' entries stay (update_json)
        update_json(path, lambda table: {**table, key: exact})
    except OSError:
        pass  # a read-only cache only costs a measurement next time
    return exact
