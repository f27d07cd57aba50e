"""dgr: a distributed GGUF runtime."""
from . import errors
from .errors import DgrError

__all__ = ["errors", "DgrError"]
