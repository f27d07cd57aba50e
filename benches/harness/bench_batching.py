"""Many sessions through one 3-stage route: dgr's batching stage loop against itself unbatched
and against llama.cpp's ``llama-batched-bench`` on the whole model (SmolLM2).

One run of ``benches/batching.py`` (its ``measure``: ``run`` then ``summarize``, the same
functions, so the same settings, ``batching.SETTINGS``), in a process of its own
(``harness.fresh``) from ``setup_cache``: a ``LocalCluster`` of 3 workers (one
thread each, 16 slots) on loopback, direct relay with the decode loop, k = 1, 4, 16 sessions
at once of ``TOKENS`` greedy tokens each, ``batched`` (the stage loop computes several
sessions' ready steps as one forward) and ``solo`` (``AsyncRoute(batching=False)``: one step a
forward); then ``llama-batched-bench -npl 1,4,16 -ntg TOKENS`` on the whole model at ``-t 1``
(one stage's threads) and ``-t 2`` (the route's 3 threads on a 2-core machine). Every track
reads that one run:

- ``track_batched<k>_decode_tokens_per_s`` / ``track_solo<k>_decode_tokens_per_s``: output
  tokens/s while every session decoded (``harness.measure.decode_tps``: llama-batched-bench's
  S_TG counterpart);
- ``track_batched<k>_tokens_per_s`` / ``track_solo<k>_tokens_per_s``: aggregate output
  tokens/s (all sessions' tokens / wall time, their prefills included);
- ``track_batched<k>_over_solo_ratio`` (decode phase); ``track_batched<k>_over_bb_t<T>_ratio``:
  the decode phase over llama-batched-bench's S_TG at k sequences, ``-t T``, and
  ``track_batched<k>_wall_over_bb_e2e_t<T>_ratio``: the wall-time rate over batched-bench's
  tokens over its prompt and generation phases (NaN when it is not built:
  ``python -m dgr.vendor build --tools llama-batched-bench``);
- ``track_batched<k>_over_pipeline_ratio``: the decode phase over the pipeline figure
  (``batching.pipeline_tps``: ``-t 1``'s S_TG at a ring group's rows times the stages busy
  at once; NaN without ``-t 1``);
- ``track_batched<k>_tpot_ms_p50`` / ``_tpot_ms_max``: the median and slowest session's time
  per output token;
- ``track_batched<k>_parity`` / ``track_solo<k>_parity``: every session's tokens equal the
  whole model's greedy tokens for its prompt computed alone (1.0 / 0.0).
"""

from __future__ import annotations

import math

from . import fresh
from .llama import tool

SESSIONS = (1, 4, 16)
TOKENS = 32
STAGES = 3
THREADS = (1, 2)  # llama-batched-bench -t: one stage's, and the route's 3 capped at 2 cores
ROUNDS = 1


def _have_batched_bench() -> bool:
    try:
        tool("llama-batched-bench")
        return True
    except Exception:
        return False


def measure(sessions=SESSIONS, tokens: int = TOKENS, stages: int = STAGES,
            threads=THREADS, rounds: int = ROUNDS) -> dict[int, dict]:
    """{k: ``batching.summarize``'s row} of one ``batching.run`` on SmolLM2;
    llama-batched-bench only when it is built (its tracks are NaN otherwise)."""
    from dgr._core import HAS_LAYER_RANGES

    if not HAS_LAYER_RANGES:
        raise NotImplementedError("partial layer ranges are not in this build")
    threads = list(threads) if _have_batched_bench() else []
    rows = fresh.call("batching", "measure", list(sessions), tokens, stages, threads, rounds,
                      timeout=900)
    return {row["sessions"]: row for row in rows}


class BatchingSmolLM2:
    """One run of benches/batching.py at 1, 4 and 16 sessions; tracks its figures."""

    timeout = 900
    repeat = 1
    number = 1

    def setup_cache(self):
        return measure()

    setup_cache.timeout = 900


def value(cache: dict, k: int, path: tuple[str, ...]) -> float:
    """``cache[k][path[0]][path[1]]...`` as a float (a bool as 1.0 / 0.0); NaN when absent."""
    v = cache.get(k)
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    return math.nan if v is None else float(v)


def _track(k: int, path: tuple[str, ...], unit: str):
    def track(self, cache):
        return value(cache, k, path)

    track.unit = unit
    track.timeout = 900
    return track


for _k in SESSIONS:
    for _name in ("batched", "solo"):
        setattr(BatchingSmolLM2, f"track_{_name}{_k}_tokens_per_s",
                _track(_k, (_name, "aggregate_tps"), "tokens/s"))
        setattr(BatchingSmolLM2, f"track_{_name}{_k}_decode_tokens_per_s",
                _track(_k, (_name, "decode_tps"), "tokens/s"))
        setattr(BatchingSmolLM2, f"track_{_name}{_k}_parity",
                _track(_k, (_name, "parity"), "bool"))
    for _key in ("tpot_ms_p50", "tpot_ms_max"):
        setattr(BatchingSmolLM2, f"track_batched{_k}_{_key}",
                _track(_k, ("batched", _key), "ms"))
    setattr(BatchingSmolLM2, f"track_batched{_k}_over_solo_ratio",
            _track(_k, ("batched_over_solo",), "ratio"))
    for _t in THREADS:
        setattr(BatchingSmolLM2, f"track_batched{_k}_over_bb_t{_t}_ratio",
                _track(_k, (f"batched_over_bb_t{_t}",), "ratio"))
        setattr(BatchingSmolLM2, f"track_batched{_k}_wall_over_bb_e2e_t{_t}_ratio",
                _track(_k, (f"batched_e2e_over_bb_t{_t}",), "ratio"))
    setattr(BatchingSmolLM2, f"track_batched{_k}_over_bound_ratio",
            _track(_k, ("batched_over_bound",), "ratio"))
    setattr(BatchingSmolLM2, f"track_batched{_k}_over_pipeline_ratio",
            _track(_k, ("batched_over_pipeline",), "ratio"))
    for _i in range(STAGES):  # each stage's CPU per output token, batched
        setattr(BatchingSmolLM2, f"track_batched{_k}_stage{_i}_cpu_ms_per_token",
                _track(_k, ("batched", "stage_cpu_ms_per_token", str(_i)), "ms"))
del _k, _name, _key, _t, _i
