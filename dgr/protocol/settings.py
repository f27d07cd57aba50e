"""The numeric engine settings, and the stage identity every frame carries.

Every stage of a route and any reference must agree on all of :data:`NUMERIC_SETTINGS` for
results to be bit-identical (they fix the KV layout, the ubatch composition and the thread
split of every reduction, so a different value reorders float sums). This module is the one
place that lists them: their short spelling in the stage identity, their command-line flags
and defaults (``add_arguments``, ``from_args``, ``to_argv``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from dgr.errors import InvalidArgument

__all__ = ["NUMERIC_SETTINGS", "DEFAULTS", "settings_tag", "stage_identity", "add_arguments",
           "from_args", "to_argv"]


@dataclass(frozen=True)
class _Setting:
    key: str          # the Engine keyword and the describe record's name
    tag: str          # its spelling in settings_tag
    flag: str         # its command-line flag
    default: Any      # the command line's default (a worker's)
    help: str


_SETTINGS = (
    _Setting("n_ctx", "ctx", "--ctx", 1024, "context tokens per session"),
    _Setting("n_slots", "slots", "--slots", 4, "concurrent sessions per worker"),
    _Setting("n_threads", "t", "--threads", 1, "CPU threads per stage"),
    _Setting("n_ubatch", "ub", "--ubatch", 64, "tokens per compute chunk"),
    _Setting("flash_attn", "fa", "--flash-attn", True, "flash attention, on or off"),
    _Setting("type_k", "k", "--type-k", "f16", "KV cache type of K"),
    _Setting("type_v", "v", "--type-v", "f16", "KV cache type of V"),
)
NUMERIC_SETTINGS = tuple(s.key for s in _SETTINGS)
#: The command line's defaults (a worker's; ``dgr.Engine`` defaults to one slot).
DEFAULTS = {s.key: s.default for s in _SETTINGS}


def settings_tag(settings: dict) -> str:
    """A short, stable spelling of the numeric engine settings, e.g. ``ctx1024.slots4.t1...``."""
    parts = []
    for s in _SETTINGS:
        v = settings[s.key]
        parts.append(f"{s.tag}{int(v) if isinstance(v, bool) else v}")
    return ".".join(parts)


def stage_identity(model_identity: str, settings: dict) -> str:
    """What a Forward frame's ``model`` field names: the model file and the numeric settings.

    Two stages compute compatible numbers only when both agree, so a frame built for another
    model *or* other settings is refused with ``ModelMismatch``.
    """
    return f"{model_identity}+{settings_tag(settings)}"


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_arguments(parser: argparse.ArgumentParser, *, per: str = "stage") -> None:
    """Add every numeric setting's flag (``--ctx``, ``--slots``, ...) to ``parser``."""
    g = parser.add_argument_group("engine settings (every stage and the reference must agree)")
    for s in _SETTINGS:
        if isinstance(s.default, bool):
            g.add_argument(s.flag, dest=s.key, type=_on_off, metavar="{on,off}",
                           default=s.default,
                           help=f"{s.help} (default {'on' if s.default else 'off'})")
        else:
            g.add_argument(s.flag, dest=s.key, type=type(s.default), default=s.default,
                           help=f"{s.help} (default {s.default})")


def from_args(args: argparse.Namespace) -> dict:
    """The settings ``add_arguments`` parsed, keyed as ``dgr.Engine`` takes them."""
    return {k: getattr(args, k) for k in NUMERIC_SETTINGS}


def to_argv(settings: dict) -> list[str]:
    """The command-line arguments that give a worker ``settings`` (a subset is fine)."""
    flags = {s.key: s for s in _SETTINGS}
    argv = []
    for k, v in settings.items():
        if k not in flags:
            raise InvalidArgument(f"unknown engine setting {k!r} (known: {', '.join(NUMERIC_SETTINGS)})")
        if isinstance(flags[k].default, bool):
            v = "on" if v else "off"
        argv += [flags[k].flag, str(v)]
    return argv
