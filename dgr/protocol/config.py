"""What the typed settings tables share (``RouteConfig``, ``WorkerConfig``, ``ServeSettings``):
a copy with some settings changed, an unknown name refused by name, and the table built from a
command line's parsed flags."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, TypeVar

from dgr.errors import InvalidArgument

__all__ = ["SettingsTable", "changed", "from_flags"]

T = TypeVar("T")

#: a settings table's flags: setting name -> (the argparse destination it reads, how)
Flags = Mapping[str, tuple[str, Callable[[Any], Any]]]


def changed(table: T, kind: str, **settings: Any) -> T:
    """A copy of the frozen dataclass ``table`` with ``settings`` changed (checked again by its
    ``__post_init__``); an unknown name is ``InvalidArgument`` naming it and the known ones
    (``kind``: what the settings are of, for the message)."""
    names = [f.name for f in dataclasses.fields(table)]
    unknown = set(settings) - set(names)
    if unknown:
        raise InvalidArgument(f"unknown {kind} setting(s) {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(names)})")
    return dataclasses.replace(table, **settings)


def from_flags(cls: type[T], kind: str, flags: Flags, args, **settings: Any) -> T:
    """``cls``'s defaults, changed by what the parsed ``args`` give for each of ``flags`` the
    command has, then by ``settings``."""
    got = {name: get(args) for name, (dest, get) in flags.items() if hasattr(args, dest)}
    return changed(cls(), kind, **got, **settings)


class SettingsTable:
    """What every typed settings table (a frozen, keyword-only dataclass that subclasses this)
    has: ``with_`` and ``from_args``. A table names ``KIND`` (what its settings are of, for
    the messages) and ``FLAGS`` (the command-line flags that set them: ``Flags``)."""

    KIND: ClassVar[str] = "settings"
    FLAGS: ClassVar[Flags] = {}

    def with_(self: T, **settings: Any) -> T:
        """A copy with ``settings`` changed (checked again); an unknown name is
        ``InvalidArgument``."""
        return changed(self, self.KIND, **settings)

    @classmethod
    def from_args(cls: type[T], args, **settings: Any) -> T:
        """The settings a command's parsed flags give (``FLAGS``: those the command has),
        then ``settings``."""
        return from_flags(cls, cls.KIND, cls.FLAGS, args, **settings)
