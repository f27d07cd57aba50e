"""dgr routes of 2-4 loopback stages vs the whole model and vs llama.cpp RPC (SmolLM2).

The numbers of ``benches/compare.py`` (the same functions, so the same settings on every
row: ``harness.common.SETTINGS``, llama-bench and RPC included), one interleaved round
measured once, in a process of its own (``harness.fresh``), from ``setup_cache``: every ``track_`` reads a ratio or a value out of it. Each
family is taken against the whole model of its own tool:
``track_dgr<k>_over_whole_<metric>_ratio`` is dgr with k stages over ``dgr.Engine`` in one
process, ``track_rpc<k>_over_llama_bench_<metric>_ratio`` llama.cpp RPC with k servers over
llama-bench's whole model, ``track_dgr<k>_over_rpc<k>_<metric>_ratio`` the two distributed
runtimes and ``track_whole_over_llama_bench_<metric>_ratio`` the two whole models.
``track_relay<k>_...`` are the same clusters driven with ``AsyncRoute(relay=True)`` (direct
relay over the data plane, pipelined prefill): over the whole model, over rpc<k> and over
dgr<k>, plus decode tokens/s, TTFT, CPU s/token (decode steps only), parity and the added
ms/token per stage (against each family's own whole-model row).
The RPC ones are NaN when llama-bench / ggml-rpc-server are not built
(``python -m dgr.vendor build --tools llama-bench,ggml-rpc-server``).
"""

from __future__ import annotations

import math

from . import fresh
from .llama import tool

STAGES = (2, 3, 4)
ROUNDS = 1
METRICS = {"decode": "decode_tps", "prefill128": "prefill128_tps",
           "prefill512": "prefill512_tps"}


def _have_llama_tools() -> bool:
    try:
        tool("llama-bench")
        tool("ggml-rpc-server")
        return True
    except Exception:
        return False


class CompareSmolLM2:
    """One round of benches/compare.py; tracks its ratios (higher is better for dgr)."""

    timeout = 1200
    repeat = 1
    number = 1

    def setup_cache(self):
        from dgr._core import HAS_LAYER_RANGES

        if not HAS_LAYER_RANGES:
            raise NotImplementedError("partial layer ranges are not in this build")
        llama = _have_llama_tools()
        return fresh.call("compare", "run_compare", list(STAGES), ROUNDS, rpc=llama,
                          llama=llama, timeout=1200)

    setup_cache.timeout = 1200


def _get(cache, name, key, section=None):
    if section is not None:  # a flat {config: value} table, e.g. added_ms_per_stage
        v = cache.get(section, {}).get(name)
    elif "/" in name:
        v = cache["ratios"].get(name, {}).get(key)
    else:
        v = cache["configs"].get(name, {}).get(key)
    return math.nan if v is None else float(v)


def _track(name, key, unit, section=None):
    def track(self, cache):
        return _get(cache, name, key, section)

    track.unit = unit
    track.timeout = 1200
    return track


# the ratios of each dgr driver (gRPC hop by hop: dgr<k>; direct relay: relay<k>) to the
# whole model and to llama.cpp RPC, plus relay to gRPC; the driver's own figures
_RATIOS = {"dgr": ("whole", "rpc{k}"), "relay": ("whole", "rpc{k}", "dgr{k}")}
for _k in STAGES:
    for _m, _key in METRICS.items():
        setattr(CompareSmolLM2, f"track_rpc{_k}_over_llama_bench_{_m}_ratio",
                _track(f"rpc{_k}/llama-bench", _key, "ratio"))
    for _c, _bases in _RATIOS.items():
        for _b in (b.format(k=_k) for b in _bases):
            for _m, _key in METRICS.items():
                setattr(CompareSmolLM2, f"track_{_c}{_k}_over_{_b}_{_m}_ratio",
                        _track(f"{_c}{_k}/{_b}", _key, "ratio"))
        setattr(CompareSmolLM2, f"track_{_c}{_k}_decode_tokens_per_s",
                _track(f"{_c}{_k}", "decode_tps", "tokens/s"))
        setattr(CompareSmolLM2, f"track_{_c}{_k}_ttft_ms", _track(f"{_c}{_k}", "ttft_ms", "ms"))
        setattr(CompareSmolLM2, f"track_{_c}{_k}_cpu_s_per_token",
                _track(f"{_c}{_k}", "cpu_s_per_token", "s"))
        setattr(CompareSmolLM2, f"track_{_c}{_k}_parity",
                _track(f"{_c}{_k}", "parity", "bool"))
    for _c in ("dgr", "relay"):
        setattr(CompareSmolLM2, f"track_{_c}{_k}_added_ms_per_stage",
                _track(f"{_c}{_k}", None, "ms", section="added_ms_per_stage"))
    setattr(CompareSmolLM2, f"track_rpc{_k}_added_ms_per_stage",
            _track(f"rpc{_k}", None, "ms", section="added_ms_per_stage"))
    setattr(CompareSmolLM2, f"track_rpc{_k}_decode_tokens_per_s",
            _track(f"rpc{_k}", "decode_tps", "tokens/s"))
for _m, _key in METRICS.items():
    setattr(CompareSmolLM2, f"track_whole_over_llama_bench_{_m}_ratio",
            _track("whole/llama-bench", _key, "ratio"))
CompareSmolLM2.track_whole_decode_tokens_per_s = _track("whole", "decode_tps", "tokens/s")
CompareSmolLM2.track_llama_bench_decode_tokens_per_s = _track("llama-bench", "decode_tps",
                                                              "tokens/s")
del _k, _m, _key, _c
