"""Private compiled core of dgr (Cython over cpp/). Import ``dgr`` instead."""

from dgr.errors import CoreNotBuilt

try:
    from dgr._cpu import require as _require_cpu
except ImportError as _e:  # pragma: no cover - a build from before dgr._cpu
    raise CoreNotBuilt(f"dgr's CPU check (dgr._cpu) is not built: {_e}. Build it from the "
                       "source checkout with `pip install -e .`.") from _e
_require_cpu()  # CpuNotSupported on a CPU the build's code does not run on (before loading it)

try:
    from dgr._core._core import (BUILD_INFO, HAS_LAYER_RANGES, Engine, Media, cpu_features,
                                 arch_supports_layer_range, backends, devices,
                                 mtmd_helper_logits)
except ImportError as _e:  # pragma: no cover - exercised by tests with a hidden build
    raise CoreNotBuilt(
        "dgr's compiled core (dgr._core._core) is not built or does not match this Python: "
        f"{_e}. Build it from the source checkout with `pip install -e .` (it fetches, patches "
        "and builds the pinned llama.cpp; `python -m dgr.vendor status` shows the cache)."
    ) from _e

__all__ = ["Engine", "Media", "BUILD_INFO", "HAS_LAYER_RANGES", "arch_supports_layer_range",
           "backends", "cpu_features", "devices", "mtmd_helper_logits"]
