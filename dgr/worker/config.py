"""How a worker serves its range: ``WorkerConfig``, one typed table of every ``Worker`` setting.

``Worker`` (and ``ThreadedWorker``) take it (``config=``) or its fields as keywords;
``python -m dgr.worker`` builds it from its flags (``WorkerConfig.from_args``, ``WORKER_FLAGS``:
one line per setting, each flag's default the setting's own). The objects a worker is given
(its engine, credentials and TLS, relay policy, name) are arguments of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr import errors
from dgr.protocol.config import SettingsTable
from dgr.transport.common import MAX_MESSAGE

__all__ = ["WorkerConfig", "WORKER_FLAGS"]


#: each setting ``python -m dgr.worker`` sets, from its parsed flags (the frame cap is not a
#: flag: tests/unit/test_worker_options.py checks that every other one is, with its default)
WORKER_FLAGS = {
    "ttl": ("ttl", lambda a: a.ttl),
    "evict_after": ("evict_after", lambda a: a.evict_after),
    "inline": ("inline_compute", lambda a: a.inline_compute),
    "inline_below_ms": ("inline_below_ms", lambda a: a.inline_below_ms),
    "cert_store": ("cert_store", lambda a: a.cert_store),
    "batching": ("batching", lambda a: a.batching),
    "native_frames": ("frames", lambda a: a.frames == "native"),
    "ring_groups": ("ring_groups", lambda a: a.ring_groups),
    "max_sessions_per_credential": ("max_sessions_per_credential",
                                    lambda a: a.max_sessions_per_credential or None),
    "max_queued_per_credential": ("max_queued_per_credential",
                                  lambda a: a.max_queued_per_credential or None),
    "busy_poll_s": ("busy_poll_us", lambda a: a.busy_poll_us * 1e-6),
    "prefix_entries": ("prefix_entries", lambda a: a.prefix_entries),
    "mmproj": ("mmproj", lambda a: a.mmproj or ""),
}


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(SettingsTable):
    """A worker's settings, checked when made (``dgr.errors.InvalidArgument`` naming it).

    Attributes
    ----------
    ttl, evict_after : float
        Session idle expiry and minimum idle time before LRU eviction (seconds).
    inline : bool
        Compute a gRPC step on the event loop thread when the stage loop is idle, instead of
        on the stage loop's thread (saves a thread handoff per step; health and describe
        then wait for the running step).
    inline_below_ms : float
        The same for a single-token step only, when recent single-token steps took less
        than this (ms). 0 (default): never. Bounds how long the loop can be blocked while
        saving the handoff where a step is short (decode of a small range).
    batching : bool
        Run the ready steps of several sessions as one forward (``dgr.worker.scheduler``);
        False: one step per forward.
    mmproj : str
        The model's projector (an ``mmproj`` GGUF) beside this stage, the first: it encodes
        images and audio on this stage's device for ``EncodeMedia`` (docs/media.md); "": none.
    ring_groups : bool
        Group a decode ring's steps by slot run when batching (docs/batching.md).
    native_frames : bool
        The data plane's frame codec and I/O in C++ (``dgr.worker.frames``) where the build
        has it; False: the Python reference.
    busy_poll_s : float
        How long a data connection polls for its next frame before sleeping (native frame I/O
        only; 0: sleep at once).
    max_sessions_per_credential, max_queued_per_credential : int or None
        What a tenant credential may hold: sessions, and steps admitted and not finished
        (None: no cap but the slots and the queue).
    prefix_entries : int or None
        The prefix store's size (``SessionTable.keep``): None (default) every slot, none on
        an engine whose slots cannot be copied and cut back at any position (MTP, DeepSeek
        V4); 0: off.
    cert_store : str or None
        The certification store whose matching lanes the capability record advertises.
    max_message : int
        The largest gRPC message and data-plane frame, bytes.
    """

    KIND = "worker"
    FLAGS = WORKER_FLAGS

    ttl: float = 600.0
    evict_after: float = 5.0
    inline: bool = False
    inline_below_ms: float = 0.0
    batching: bool = True
    ring_groups: bool = True
    native_frames: bool = True
    busy_poll_s: float = 0.0
    max_sessions_per_credential: int | None = None
    max_queued_per_credential: int | None = None
    prefix_entries: int | None = None
    cert_store: str | None = None
    mmproj: str = ""
    max_message: int = MAX_MESSAGE

    def __post_init__(self):
        def refuse(name: str, rule: str):
            raise errors.InvalidArgument(f"{name} ({FLAG_NAMES.get(name, 'no flag')}) {rule}, "
                                         f"got {getattr(self, name)}")

        if not self.ttl > 0:
            refuse("ttl", "must be > 0")
        for name in ("evict_after", "inline_below_ms", "busy_poll_s"):
            if getattr(self, name) < 0:
                refuse(name, "must be >= 0")
        for name in ("max_sessions_per_credential", "max_queued_per_credential"):
            v = getattr(self, name)
            if v is not None and v < 1:
                refuse(name, "must be >= 1 (None: no cap)")
        if self.prefix_entries is not None and self.prefix_entries < 0:
            refuse("prefix_entries", "must be >= 0")
        if self.busy_poll_s and not self.native_frames:
            raise errors.InvalidArgument("busy polling (--busy-poll-us) needs the native frame "
                                         "I/O (--frames native): the Python path cannot poll "
                                         "without the GIL")
        if self.max_message < 1:
            refuse("max_message", "must be >= 1")

#: the flag of each setting, for the errors (``--busy-poll-us`` is in microseconds)
FLAG_NAMES = {"ttl": "--ttl", "evict_after": "--evict-after", "inline": "--inline-compute",
              "inline_below_ms": "--inline-below-ms", "cert_store": "--cert-store",
              "batching": "--no-batching", "native_frames": "--frames",
              "ring_groups": "--no-ring-groups",
              "max_sessions_per_credential": "--max-sessions-per-credential",
              "max_queued_per_credential": "--max-queued-per-credential",
              "busy_poll_s": "--busy-poll-us", "prefix_entries": "--prefix-entries",
              "mmproj": "--mmproj"}
