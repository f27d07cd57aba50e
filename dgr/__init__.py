"""dgr: a distributed GGUF runtime (one model split by layer ranges across processes)."""

from dgr import errors
from dgr.errors import DgrError

__all__ = ["errors", "DgrError", "Engine", "Media", "devices", "Route", "RouteSession", "RouteConfig",
           "AsyncRoute", "AsyncRouteSession"]
__version__ = "0.1.0"

# Heavy or compiled parts load on first use, so `python -m dgr.vendor` works before any build.
_LAZY = {
    "Engine": ("dgr.core.engine", "Engine"),
    "Media": ("dgr.core.media", "Media"),
    "devices": ("dgr.core", "devices"),
    "Route": ("dgr.driver.route", "Route"),
    "RouteSession": ("dgr.driver.route", "RouteSession"),
    "RouteConfig": ("dgr.driver.config", "RouteConfig"),
    "AsyncRoute": ("dgr.driver.route", "AsyncRoute"),
    "AsyncRouteSession": ("dgr.driver.route", "AsyncRouteSession"),
}


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'dgr' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
