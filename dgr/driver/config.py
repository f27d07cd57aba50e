"""How a route drives its stages: ``RouteConfig``, one typed table of every route setting.

``AsyncRoute`` and ``Route`` take it (``config=``) or its fields as keywords; the command line
builds it from its flags (``RouteConfig.from_args``: ``ROUTE_FLAGS`` names the flag of each
field a command has). The objects a route is given (its endpoints, provider, tokenizer and
security) are not settings and stay arguments of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr import errors
from dgr.protocol import wire
from dgr.protocol.config import SettingsTable
from dgr.transport.client import DEFAULT_STEP_TIMEOUT, DEFAULT_TIMEOUT

__all__ = ["RouteConfig", "ROUTE_FLAGS"]


#: each setting a command line may set: (the argparse destination it reads, how)
ROUTE_FLAGS = {
    "codec": ("codec", lambda a: a.codec),
    "timeout": ("timeout", lambda a: a.timeout),
    "relay": ("relay", lambda a: {"auto": None, "on": True, "off": False}[a.relay]),
    "speculate": ("speculate", lambda a: "" if a.speculate == "off" else a.speculate),
    "max_draft": ("max_draft", lambda a: a.max_draft),
    "mixed_devices": ("mixed_devices", lambda a: a.mixed_devices),
}


@dataclass(frozen=True, kw_only=True)
class RouteConfig(SettingsTable):
    """A route's settings, checked when made (``dgr.errors.InvalidArgument`` or
    ``UnknownCodec``).

    Attributes
    ----------
    timeout : float
        Deadline of control calls (describe, release, tokenize), seconds.
    step_timeout : float
        Deadline of one step on one stage, seconds.
    connect_timeout : float
        How long recovery waits for a stage to come back (a restarted worker loads its range
        first), seconds.
    codec : str
        Boundary codec on the wire (``"raw"``: bit-exact, the default; ``"f16"``, ``"bf16"``,
        ``"q8"`` are lossy, opt-in). ``compress`` adds zstd.
    max_retries : int
        Recoveries (re-prefill under a new epoch) attempted for one step.
    spares : tuple of str
        More workers for the default pool (same ranges as the route's stages).
    deadline_floor, deadline_factor : float
        A step's deadline on a stage is ``max(deadline_floor, deadline_factor * p99)`` of
        that stage's recent step times (per token for multi-token steps), at most
        ``step_timeout``; ``step_timeout`` until 8 steps were measured.
    probe_timeout : float
        Deadline of the connect and describe that vet a replacement worker, seconds.
    backoff : float
        First pause between recovery attempts (doubles each time, at most 2 s), seconds.
    relay : bool or None
        Direct relay over the workers' fast data plane (docs/dataplane.md): the driver sends
        each step to the first stage, every stage forwards its boundary straight to the next
        and the last stage answers the driver; a prompt's chunks are all sent at once, so the
        stages work on consecutive chunks at the same time (pipelined prefill). Same tokens
        and logits as ``relay=False``, which relays every boundary through the driver over
        gRPC. Recovery always replays over gRPC (it finds which stage failed). Needs every
        worker to serve a data port and the raw codec. None (default): relay when the codec
        is raw and every stage's data port answers at ``connect``, else the gRPC path.
    loop : bool
        With relay, ``generate`` hands decoding to the stages: the last stage feeds each token
        it samples straight back to the first stage (``Forward.steps``), so no driver round
        trip sits between two tokens; the driver streams the tokens as they arrive. It stops
        at ``max_tokens`` and at end-of-generation tokens. False: one driver round trip per
        token.
    loop_window : int
        The decode loop runs this many tokens at a time; the next window starts when the
        reader asks for its first token. So the stages run at most this far ahead of a
        consumer that is slow or stops early (a stop string, a closed stream), and one
        driver hop per window is added (32 by default).
    batching : bool
        Whether the stages may compute this route's steps in one forward with other
        sessions' steps (``dgr.worker.scheduler``; docs/batching.md). True by default.
        False marks every step ``Forward.solo``. A step that returns logits (the parity
        mode, ``logits=True``) is always solo.
    speculate : str
        Speculative decoding in the decode loop (docs/speculative.md): the last stage drafts
        the next tokens and the ring verifies them in one step, so a trip can make several
        tokens. ``"ngram"``: drafts from the session's own tokens (prompt lookup; the last
        stage gets the token ids); ``"mtp"``: from the model's multi-token-prediction block,
        which the last stage's worker loads (``--mtp``). ``""`` (default): off. The tokens
        are the ones plain decoding makes from the same rows; the parity mode
        (``logits=True``) never speculates.
    max_draft : int
        At most this many drafts per trip (the last stage adapts the number to what it
        measures is accepted and what a longer step costs, down to none).
    mixed_devices : bool
        Whether the stages may compute on different kinds of device (``check_route``).
    encoder : str
        ``host:port`` of a worker whose projector (``--mmproj``) encodes this route's media
        instead of the first stage's (``dgr serve --mmproj-on front``: one beside the front);
        it serves the same model (layers from 0) and computes no step. ``""``: the first
        stage's (docs/media.md).
    """

    KIND = "route"
    FLAGS = ROUTE_FLAGS

    timeout: float = DEFAULT_TIMEOUT
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    connect_timeout: float = 30.0
    codec: str = "raw"
    compress: bool = False
    max_retries: int = 3
    spares: tuple[str, ...] = ()
    deadline_floor: float = 2.0
    deadline_factor: float = 10.0
    probe_timeout: float = 1.0
    backoff: float = 0.05
    relay: bool | None = None
    loop: bool = True
    loop_window: int = 32
    batching: bool = True
    speculate: str = ""
    max_draft: int = 8
    mixed_devices: bool = False
    encoder: str = ""

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise the values once, here
        set_(self, "spares", tuple(self.spares))
        if self.codec not in wire.CODECS:
            raise errors.UnknownCodec(f"unknown codec {self.codec!r} (known: "
                                      f"{', '.join(wire.CODECS)})")
        if self.relay and (self.codec != "raw" or self.compress):
            raise errors.InvalidArgument(
                f"relay=True carries raw f32 boundaries stage to stage; codec={self.codec!r}, "
                f"compress={self.compress} need relay=False")
        if self.loop_window < 1:
            raise errors.InvalidArgument(f"loop_window must be >= 1, got {self.loop_window}")
        if self.speculate not in wire.DRAFTERS:
            raise errors.InvalidArgument(
                f"unknown speculate={self.speculate!r} (known: ngram, mtp; '' for none)")
        if not 1 <= self.max_draft <= wire.MAX_DRAFT:
            raise errors.InvalidArgument(
                f"max_draft must be in [1, {wire.MAX_DRAFT}], got {self.max_draft}")
        for name in ("timeout", "step_timeout", "connect_timeout", "probe_timeout"):
            if not getattr(self, name) > 0:
                raise errors.InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0 or self.backoff < 0:
            raise errors.InvalidArgument(f"max_retries and backoff must be >= 0, got "
                                         f"{self.max_retries}, {self.backoff}")

    @property
    def relay_wanted(self) -> bool:
        """Whether the route tries direct relay at ``connect`` (``relay``, or None: when the
        codec is raw and uncompressed)."""
        if self.relay is None:
            return self.codec == "raw" and not self.compress
        return bool(self.relay)
