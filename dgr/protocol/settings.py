"""The engine settings that decide numerics, and the stage identity every frame carries.

Every stage of a route and any reference must agree on all of :data:`NUMERIC_SETTINGS` for
results to be bit-identical (they fix the KV layout, the ubatch composition and the thread
split of every reduction, so a different value reorders float sums). The compute device
decides numerics too (another backend runs other kernels), but its *name* is a machine's own
(``Vulkan0`` here may be another GPU than ``Vulkan0`` there): what a route compares is the
device's kind, :func:`compute_kind` (backend and device model), which the stage identity
carries. This module is the one place that lists the settings: their short spelling in the
stage identity, their command-line flags and defaults (``add_arguments``, ``from_args``,
``to_argv``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from dgr.errors import InvalidArgument

__all__ = ["NUMERIC_SETTINGS", "ENGINE_SETTINGS", "DEFAULTS", "CPU", "settings_tag", "canonical",
           "complete", "given",
           "compute_kind", "is_software_device", "stage_identity", "add_arguments", "from_args",
           "to_argv"]


@dataclass(frozen=True)
class _Setting:
    key: str          # the Engine keyword and the describe record's name
    tag: str          # its spelling in settings_tag
    flag: str         # its command-line flag
    default: Any      # the command line's default (a worker's)
    help: str
    #: a setting added after identities were first kept: ``settings_tag`` spells it only away
    #: from its default, so stages that leave it alone keep the identities they had
    later: bool = False


_SETTINGS = (
    _Setting("n_ctx", "ctx", "--ctx", 0,
             "context tokens per session; 0: the model's trained context, capped by what "
             "--kv-budget holds (the stage logs what it chose)"),
    _Setting("n_slots", "slots", "--slots", 4, "concurrent sessions per worker"),
    _Setting("n_threads", "t", "--threads", 1, "CPU threads per stage"),
    _Setting("n_ubatch", "ub", "--ubatch", 64, "tokens per compute chunk"),
    _Setting("flash_attn", "fa", "--flash-attn", True, "flash attention, on or off"),
    _Setting("type_k", "k", "--type-k", "f16", "KV cache type of K"),
    _Setting("type_v", "v", "--type-v", "f16", "KV cache type of V"),
    _Setting("batch_invariant", "bi", "--batch-invariant", False,
             "batch-invariant kernels (cpu device only): ggml's CPU reference kernels, so a "
             "row's bits do not depend on what else its forward computes (a chunk of any "
             "length, other sessions' rows, drafts, any KV length); prompt caches then keep "
             "every row, batched sessions and speculation give the whole model's own tokens "
             "at every context length; prefill is slower (docs/performance.md)", later=True),
)
NUMERIC_SETTINGS = tuple(s.key for s in _SETTINGS)
#: The compute device: not in the settings tag (its name is the machine's own); the stage
#: identity carries its kind (:func:`compute_kind`) instead.
_DEVICE = _Setting("device", "", "--device", "cpu",
                   "compute device: cpu, or a ggml device such as Vulkan0 or CUDA0 (python -m "
                   "dgr devices lists them); every owned layer, its KV cache and the head go there")
#: The memory the context of ``--ctx 0`` may take: not numeric (a cache's size does not change
#: a row's bits), and not in the identity.
_KV_BUDGET = _Setting("kv_budget_mib", "", "--kv-budget", 0,
                      "MiB the KV cache of all sessions may take with --ctx 0 (0: half the "
                      "memory free once the weights are in: the system's available memory "
                      "on the cpu device, the device's free memory elsewhere)")
_OTHER = (_DEVICE, _KV_BUDGET)
#: Every setting an engine takes from the command line: the numeric ones, the device and the
#: KV budget.
ENGINE_SETTINGS = NUMERIC_SETTINGS + tuple(s.key for s in _OTHER)
#: The command line's defaults (a worker's; ``dgr.Engine`` defaults to one slot and 1024
#: context tokens).
DEFAULTS = {s.key: s.default for s in (*_SETTINGS, *_OTHER)}
#: The compute kind of the CPU device.
CPU = "cpu"

#: Device descriptions of software implementations of a GPU API (they run on the CPU): a lane
#: certified on one is recorded as such, never as certified on hardware.
_SOFTWARE_DEVICES = ("llvmpipe", "lavapipe", "swiftshader", "softpipe")


def settings_tag(settings: dict) -> str:
    """A short, stable spelling of the numeric engine settings, e.g. ``ctx1024.slots4.t1...``."""
    parts = []
    for s in _SETTINGS:
        v = settings.get(s.key, s.default) if s.later else settings[s.key]
        if s.later and v == s.default:
            continue
        parts.append(f"{s.tag}{int(v) if isinstance(v, bool) else v}")
    return ".".join(parts)


def canonical(settings: dict) -> dict:
    """``settings`` as records that outlive a build compare and name them (a lane's, a
    capability record's): a setting added after such records were first kept is left out at
    its default, so a record made before it still matches, and keeps its id."""
    later = {s.key: s.default for s in _SETTINGS if s.later}
    return {k: v for k, v in settings.items() if not (k in later and v == later[k])}


def complete(settings: dict) -> dict:
    """``settings`` with every setting added later (``canonical``'s) at its default where it is
    missing: an engine built before such a setting existed computes as its default does."""
    return {**{s.key: s.default for s in _SETTINGS if s.later}, **settings}


def compute_kind(backend: str, description: str = "") -> str:
    """The kind of a compute device, as stages and lanes compare it: ``"cpu"`` for the CPU
    backend, else ``"<backend>:<device model>"``, e.g. ``"vulkan:llvmpipe (LLVM 15.0.6, 256
    bits)"`` or ``"cuda:NVIDIA H200"`` (the same for every device of that model)."""
    b = (backend or CPU).strip().lower()
    if b == CPU:
        return CPU
    return f"{b}:{description.strip()}"


def is_software_device(description: str) -> bool:
    """Whether a device is a software implementation of its API (lavapipe's ``llvmpipe``,
    SwiftShader), which computes on the CPU."""
    d = description.lower()
    return any(name in d for name in _SOFTWARE_DEVICES)


def stage_identity(model_identity: str, settings: dict, compute: str = CPU) -> str:
    """What a Forward frame's ``model`` field names: the model file, the numeric settings and,
    off the CPU, the compute kind (:func:`compute_kind`).

    Two stages compute compatible numbers only when all agree, so a frame built for another
    model, other settings or another kind of device is refused with ``ModelMismatch``. A CPU
    stage's identity is what it was before devices existed.
    """
    ident = f"{model_identity}+{settings_tag(settings)}"
    if compute != CPU:
        ident += f"+{compute}"
    return ident


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_arguments(parser: argparse.ArgumentParser, *, per: str = "stage") -> None:
    """Add every numeric setting's flag (``--ctx``, ``--slots``, ...) to ``parser``."""
    g = parser.add_argument_group("engine settings (every stage and the reference must agree)")
    g.add_argument(_DEVICE.flag, dest=_DEVICE.key, default=_DEVICE.default, metavar="DEVICE",
                   help=f"{_DEVICE.help} (default {_DEVICE.default})")
    g.add_argument(_KV_BUDGET.flag, dest=_KV_BUDGET.key, type=int, default=_KV_BUDGET.default,
                   metavar="MIB", help=_KV_BUDGET.help)
    for s in _SETTINGS:
        if isinstance(s.default, bool):
            g.add_argument(s.flag, dest=s.key, type=_on_off, metavar="{on,off}",
                           default=s.default,
                           help=f"{s.help} (default {'on' if s.default else 'off'})")
        else:
            g.add_argument(s.flag, dest=s.key, type=type(s.default), default=s.default,
                           help=f"{s.help} (default {s.default})")


def from_args(args: argparse.Namespace) -> dict:
    """The settings ``add_arguments`` parsed, keyed as ``dgr.Engine`` takes them (the numeric
    ones and ``device``)."""
    return {k: getattr(args, k) for k in ENGINE_SETTINGS}


def given(args: argparse.Namespace) -> list[str]:
    """The engine flags ``add_arguments`` parsed away from their defaults (a command that starts
    no engine refuses them rather than ignore them)."""
    return [s.flag for s in (*_SETTINGS, *_OTHER) if getattr(args, s.key, s.default) != s.default]


def to_argv(settings: dict) -> list[str]:
    """The command-line arguments that give a worker ``settings`` (a subset is fine)."""
    flags = {s.key: s for s in (*_SETTINGS, *_OTHER)}
    argv = []
    for k, v in settings.items():
        if k not in flags:
            raise InvalidArgument(f"unknown engine setting {k!r} (known: {', '.join(ENGINE_SETTINGS)})")
        if isinstance(flags[k].default, bool):
            v = "on" if v else "off"
        argv += [flags[k].flag, str(v)]
    return argv
