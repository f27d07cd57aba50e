"""The engine: ``dgr.core.Engine`` (one layer range of a GGUF model) over the compiled core.

- ``dgr.core.engine``: ``Engine``, the public face of the Cython binding (``dgr._core``) of the
  project's C++ engine (``cpp/``) over the patched llama.cpp.
- ``dgr.core.local``: range engines chained in one process, and the reference generation loop.
"""

from dgr._core import BUILD_INFO, HAS_LAYER_RANGES
from dgr.core.engine import Engine
from dgr.core.local import LocalChain, generate_local

__all__ = ["Engine", "LocalChain", "generate_local", "BUILD_INFO", "HAS_LAYER_RANGES"]
