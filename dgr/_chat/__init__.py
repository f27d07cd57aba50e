"""Private compiled binding of llama.cpp's chat code (``common/chat``): templates with tools and
reasoning, and the parsers of tool calls. It loads no model and opens no device, so the HTTP
front may use it where the engine (``dgr._core``) is never imported. Use ``dgr.serve.chat``."""

from dgr.errors import CoreNotBuilt

try:
    from dgr._cpu import require as _require_cpu
except ImportError as _e:  # pragma: no cover - a build from before dgr._cpu
    raise CoreNotBuilt(f"dgr's CPU check (dgr._cpu) is not built: {_e}. Build it from the "
                       "source checkout with `pip install -e .`.") from _e
_require_cpu()  # CpuNotSupported on a CPU the build's code does not run on (before loading it)

try:
    from dgr._chat._chat import ChatParser, ChatTemplate
except ImportError as _e:  # pragma: no cover - exercised by tests with a hidden build
    raise CoreNotBuilt(
        "dgr's chat binding (dgr._chat._chat) is not built or does not match this Python: "
        f"{_e}. Build it from the source checkout with `pip install -e .`."
    ) from _e

__all__ = ["ChatParser", "ChatTemplate"]
