"""Private compiled core of dgr (Cython over cpp/). Import ``dgr`` instead."""

try:
    from dgr._core._core import (BUILD_INFO, HAS_LAYER_RANGES, Engine, Media,
                                 arch_supports_layer_range, backends, devices,
                                 mtmd_helper_logits)
except ImportError as _e:  # pragma: no cover - exercised by tests with a hidden build
    from dgr.errors import CoreNotBuilt

    raise CoreNotBuilt(
        "dgr's compiled core (dgr._core._core) is not built or does not match this Python: "
        f"{_e}. Build it from the source checkout with `pip install -e .` (it fetches, patches "
        "and builds the pinned llama.cpp; `python -m dgr.vendor status` shows the cache)."
    ) from _e

__all__ = ["Engine", "Media", "BUILD_INFO", "HAS_LAYER_RANGES", "arch_supports_layer_range",
           "backends", "devices", "mtmd_helper_logits"]
