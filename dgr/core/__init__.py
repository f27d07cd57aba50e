"""The engine: ``dgr.core.Engine`` (one layer range of a GGUF model) over the compiled core.

- ``dgr.core.engine``: ``Engine``, the public face of the Cython binding (``dgr._core``) of the
  project's C++ engine (``cpp/``) over the patched llama.cpp.
- ``dgr.core.local``: range engines chained in one process, and the reference generation loop.
"""

from dgr._core import BUILD_INFO, HAS_LAYER_RANGES, backends, cpu_features
from dgr._core import devices as _devices
from dgr.core.engine import Engine
from dgr.core.local import LocalChain, generate_local
from dgr.protocol.settings import compute_kind, is_software_device

__all__ = ["Engine", "LocalChain", "generate_local", "BUILD_INFO", "HAS_LAYER_RANGES", "backends",
           "devices"]


def devices() -> list[dict]:
    """The compute devices this build can use (ggml's backend registry), the CPU first: per
    device ``name`` (what ``Engine(device=...)`` and ``--device`` take), ``description``,
    ``type`` (cpu, gpu, igpu, accel), ``backend``, ``driver``, ``kind`` (as routes and lanes
    compare it), ``software`` (a software implementation such as lavapipe) and
    ``memory_free``/``memory_total`` in bytes; the CPU's also ``cpu_variant`` (the build's CPU
    code: ``native``, ``x86-64-v3``) and ``cpu_compiled`` (what ggml's CPU backend was compiled
    for: ``AVX2``, ``F16C``, ...)."""
    out = []
    for d in sorted(_devices(), key=lambda d: d["type"] != "cpu"):  # the CPU first
        d = dict(d)
        d["kind"] = compute_kind(d["backend"], d["description"])
        d["software"] = d["type"] != "cpu" and is_software_device(d["description"])
        if d["type"] == "cpu":
            d["cpu_variant"] = BUILD_INFO.get("cpu_variant", "native")
            d["cpu_compiled"] = cpu_features()
        out.append(d)
    return out
