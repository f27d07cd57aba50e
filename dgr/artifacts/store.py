"""Where model artifacts live: the store location and the rule that none lives under /home.

dgr keeps exact model artifacts (split GGUFs, slices, their hashed manifests) on mounted-drive
storage and forbids any model artifact under ``/home``. The store is chosen, in
order, by an explicit location (``--store DIR``), the ``DGR_STORE`` environment variable, or
the development cache ``$DGR_CACHE`` (``dgr.vendor.cache_root()``). An explicit store is
production storage: under ``/home`` it is refused (``StorageLocationError``), as is every
artifact ``dgr artifacts`` writes there; the development cache under ``/home`` only warns,
once per process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dgr.errors import StorageLocationError
from dgr.vendor import cache_root

__all__ = ["STORE_ENV", "FORBIDDEN_ROOT", "store_root", "is_explicit", "under_forbidden_root",
           "check_production_path", "resolve_output", "warn_if_dev_cache_under_home"]

STORE_ENV = "DGR_STORE"

#: no model artifact may be placed under this directory (module attribute so tests can move it)
FORBIDDEN_ROOT = Path("/home")

_log = logging.getLogger("dgr.artifacts.store")
_warned: set[str] = set()


def is_explicit(store: str | os.PathLike | None = None) -> bool:
    """Whether a store was chosen (``store`` given or ``DGR_STORE`` set), i.e. production
    storage rather than the development cache."""
    return store is not None or bool(os.environ.get(STORE_ENV))


def store_root(store: str | os.PathLike | None = None) -> Path:
    """The store directory: ``store``, else ``$DGR_STORE``, else the development cache
    (``$DGR_CACHE``, by default ``~/.cache/dgr``). An explicit store under ``/home`` raises
    ``StorageLocationError``; the development cache under ``/home`` warns once."""
    if store is not None:
        root = Path(store).expanduser()
    elif os.environ.get(STORE_ENV):
        root = Path(os.environ[STORE_ENV]).expanduser()
    else:
        root = cache_root()
        warn_if_dev_cache_under_home(root)
        return root
    check_production_path(root, what="the artifact store")
    return root


def under_forbidden_root(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    """Whether ``path`` (made absolute, symlinks resolved) lies in ``root`` (default
    ``FORBIDDEN_ROOT``, i.e. ``/home``) or is ``root`` itself."""
    root = Path(FORBIDDEN_ROOT if root is None else root).resolve()
    p = Path(path).expanduser().resolve()
    return p == root or root in p.parents


def check_production_path(path: str | os.PathLike, *, what: str = "a model artifact") -> Path:
    """Return ``path`` if a production artifact may be written there; raise
    ``StorageLocationError`` (saying where to put it instead) when it lies under ``/home``."""
    p = Path(path).expanduser()
    if under_forbidden_root(p):
        raise StorageLocationError(
            f"refusing to place {what} at {p}: no model artifact may live under "
            f"{FORBIDDEN_ROOT} (they belong on mounted-drive storage); put it on a "
            f"mounted drive instead, e.g. `--store /mnt/models` or {STORE_ENV}=/mnt/models")
    return p


def resolve_output(out: str | os.PathLike, store: str | os.PathLike | None = None) -> Path:
    """Where ``dgr artifacts`` writes ``out``: a relative path lands in the store when one is
    chosen (``store`` or ``DGR_STORE``), else in the current directory; either way a path under
    ``/home`` is refused with ``StorageLocationError``."""
    p = Path(out).expanduser()
    if not p.is_absolute() and is_explicit(store):
        p = store_root(store) / p
        check_production_path(p)
        p.parent.mkdir(parents=True, exist_ok=True)
    return check_production_path(p)


def warn_if_dev_cache_under_home(root: str | os.PathLike | None = None) -> bool:
    """Log a warning (once per process and directory) when the development cache lies under
    ``/home``; returns whether it does."""
    root = Path(cache_root() if root is None else root)
    if not under_forbidden_root(root):
        return False
    key = str(root)
    if key not in _warned:
        _warned.add(key)
        _log.warning("the development cache %s lies under %s, where no model artifact may be "
                     "placed; set DGR_CACHE (or %s for artifacts) to a mounted drive",
                     root, FORBIDDEN_ROOT, STORE_ENV)
    return True
