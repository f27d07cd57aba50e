"""Whether a prompt's rows computed in one partial prefill chunk are the rows any other partial
chunk computes at those positions, measured on one stage's engine (the worker's
``Describe.prefix_rows_exact``; docs/serve.md "Prompt cache").

A fresh prefill of ``n`` tokens runs chunks of ``n_ubatch`` from position 0: whole chunks,
then one partial chunk of the ``n % n_ubatch`` tokens left. A kept session's cache may serve a
later prompt past its whole chunks only where the rows it holds there are the rows the later
prompt's own partial chunk would compute: the same bits although they came from a chunk of
another length (the earlier prompt's), and although the later prompt's tail is prefilled as a
chunk of its own. Whether that holds is the kernels' business (on the CPU, ggml's flash
attention takes another path for a chunk of at least 64 rows than for fewer; matrix products
may switch kernels by batch size), so it is measured on the stage's engine, never assumed:
``rows_exact`` computes ``n_ubatch - 1`` rows as one chunk and as two chunks split at several
points, and compares every row's output bit for bit (boundary rows, or logits on the last
stage). A route reuses partial-chunk rows only when every stage says so
(``dgr.driver.session.AsyncRouteSession.reusable``).
"""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np

from dgr.artifacts.storage import atomic_write
from dgr.vendor import cache_root

__all__ = ["rows_exact", "rows_exact_cached", "single_rows_exact", "single_rows_exact_cached"]

_lock = threading.Lock()


def _out(engine, slot: int, first: int, tokens, boundary, a: int, b: int) -> np.ndarray:
    kw = {}
    if tokens is not None:
        kw["tokens"] = tokens[a:b]
    if boundary is not None:
        kw["boundary"] = boundary[a:b]
    if engine.is_last:
        kw["logits"] = "all"
    return np.array(engine.forward(slot, first + a, **kw), copy=True)


def _probe(engine, seed: int):
    """The checks' input: ``n = n_ubatch - 1`` rows (at most 255, at most n_ctx), seeded
    token ids where the range takes them and a random boundary where it does not start the
    model; (n, tokens, boundary)."""
    n = min(int(engine.settings["n_ubatch"]) - 1, 255, int(engine.settings["n_ctx"]))
    rng = np.random.default_rng(seed)
    tokens = boundary = None
    if engine.is_first or engine.needs_token_ids:
        lo = 100 if engine.n_vocab > 1000 else 0
        tokens = rng.integers(lo, engine.n_vocab, size=max(n, 0), dtype=np.int32)
    if not engine.is_first:
        boundary = rng.standard_normal((max(n, 0), int(engine.n_embd_boundary)),
                                       dtype=np.float32)
    return n, tokens, boundary


def rows_exact(engine, *, slot: int = 0, seed: int = 7) -> bool:
    """Whether ``engine`` (any layer range) computes a partial chunk's rows as another
    partial chunk does: ``n_ubatch - 1`` rows (at most 255) once as one chunk and as two
    chunks split in the middle and two rows before the end, every row compared
    bit for bit. ``slot`` is released before and after. False when ``n_ubatch`` is below 4
    (no two partial chunks of two rows or more) or the engine cannot run the check."""
    n, tokens, boundary = _probe(engine, seed)
    if n < 3:
        return False
    splits = sorted({max(2, n // 2), n - 2} - {0, n})
    try:
        engine.release(slot)
        whole = _out(engine, slot, 0, tokens, boundary, 0, n)
        for s in splits:
            engine.release(slot)
            parts = np.concatenate([_out(engine, slot, 0, tokens, boundary, 0, s),
                                    _out(engine, slot, 0, tokens, boundary, s, n)])
            if parts.shape != whole.shape or parts.tobytes() != whole.tobytes():
                return False
        return True
    finally:
        engine.release(slot)


def single_rows_exact(engine, *, slot: int = 0, seed: int = 11) -> bool:
    """Whether ``engine`` computes rows one per step (a decode step's row) as a partial chunk
    computes them: ``n_ubatch - 1`` rows (at most 255) once as one chunk, then as single-row
    steps from position 0 and from the middle (after a chunk of the first half), every row
    compared bit for bit. Then a reply's decoded rows may serve a later prompt that holds the
    reply, past its whole chunks (``Describe.prefix_single_rows_exact``). ``slot`` is
    released before and after; False when ``n_ubatch`` is below 4."""
    n, tokens, boundary = _probe(engine, seed)
    if n < 3:
        return False
    try:
        engine.release(slot)
        whole = _out(engine, slot, 0, tokens, boundary, 0, n)
        for start in (0, n // 2):
            engine.release(slot)
            parts = [_out(engine, slot, 0, tokens, boundary, 0, start)] if start else []
            parts += [_out(engine, slot, 0, tokens, boundary, i, i + 1) for i in range(start, n)]
            got = np.concatenate(parts)
            if got.shape != whole.shape or got.tobytes() != whole.tobytes():
                return False
        return True
    finally:
        engine.release(slot)


def _key(engine) -> str:
    from dgr.control.capability import build_info, cpu_features

    info = engine.describe()
    facts = [build_info(), info["identity"], list(engine.layers), dict(engine.settings),
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


def _cached(engine, suffix: str, measure, slot: int) -> bool:
    path = cache_root() / "prefix-rows.json"
    try:
        key = _key(engine) + suffix
    except Exception:  # noqa: BLE001 - an engine without a build or identity: not measured
        return False
    with _lock:
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict):
            table = {}
        if isinstance(table.get(key), bool):
            return table[key]
    try:
        exact = measure(engine, slot=slot)
    except Exception:  # noqa: BLE001 - an engine that cannot run the check reuses whole chunks
        return False
    with _lock:
        try:
            table = json.loads(path.read_text())
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[key] = exact
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(table, indent=0).encode())
        except OSError:
            pass  # a read-only cache only costs a measurement next time
    return exact
