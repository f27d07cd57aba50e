"""Where a data-plane step's frames go once it computed (docs/dataplane.md).

- hop by hop (``Forward.reply_to`` empty): the reply goes back on the connection it came on;
- direct relay, not the last stage: the next ``Forward`` (this stage's boundary) goes to the
  next stage named by ``Forward.relay``, over a pooled link;
- direct relay, last stage: the ``Result`` goes to the route's return connection (the
  driver's, registered by its ``Hello``); with a decode loop (``Forward.steps``) the next
  step goes to the route's first stage too: the token just sampled and, when the loop
  speculates (``Forward.speculate``), the drafts after it (``dgr.worker.speculation``).

A refused or failed step's ``ErrorReply`` goes to the return connection as well when the
step was relayed, else back to the sender.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import msgspec

from dgr.protocol import wire
from dgr.transport.dataplane import FrameSocket, Links
from dgr.worker.frames import Frames
from dgr.worker.step import Step

__all__ = ["Forwarder"]

log = logging.getLogger("dgr.worker")


class Forwarder:
    """The data plane's outgoing side of one stage: return connections and links.

    Parameters
    ----------
    layer_end : int
        The stage's range end (the layer a relayed boundary continues at).
    is_first, is_last : bool
        Whether the stage is its route's first and last.
    """

    def __init__(self, layer_end: int, is_first: bool, is_last: bool,
                 frames: Frames | None = None, security=None, speculator=None):
        self.layer_end = layer_end
        self.is_first, self.is_last = is_first, is_last
        #: the last stage's drafting (dgr.worker.speculation.Speculator), if any
        self.speculator = speculator
        self.frames = frames or Frames()
        #: links present ``security``'s credential and TLS (None: the environment's)
        self.links = Links(conn_class=self.frames.conn_class, security=security)
        self._returns: dict[str, FrameSocket] = {}  # route id -> the driver's connection
        self._lock = threading.Lock()

    def __contains__(self, route: object) -> bool:
        """Whether ``route`` has a return connection here."""
        return route in self._returns

    def hello(self, conn: FrameSocket, route: str) -> None:
        """``conn`` is the return connection of ``route``: register it, then echo the Hello."""
        conn.route = route
        with self._lock:
            self._returns[route] = conn
        self.send_back(conn, "", wire.encode(wire.Hello(route=route)))

    def forget(self, conn: FrameSocket) -> None:
        """``conn`` ended: it is no longer its route's return connection."""
        if conn.route:
            with self._lock:
                if self._returns.get(conn.route) is conn:
                    del self._returns[conn.route]

    def send_back(self, conn: FrameSocket, reply_to: str, frame, payload=None) -> None:
        """Send a reply (``frame``, or the pieces ``frame`` + ``payload``): to the route's
        return connection when relayed, else to ``conn``."""
        # without a return connection (no Hello) to the sender: a driver reads it there; a
        # previous stage's link drops it
        target = self._returns.get(reply_to, conn) if reply_to else conn
        try:
            target.send_parts(frame, payload)
        except OSError as e:
            log.info("return connection of route %s broke: %s", reply_to or conn.name, e)

    def send_on(self, conn: FrameSocket, step: Step,
                reply: Callable[[Step, bytearray], tuple], buf: bytearray,
                on_error: Callable[[BaseException], None] | None = None) -> None:
        """Send a computed step's frames; ``reply(step, buf)`` encodes its ``Result`` (only
        when it is sent) as the pieces ``(head, payload)`` to send, ``buf`` the calling
        thread's reusable frame buffer. Inside ``Links.burst`` a relay or loop frame that cannot
        be sent at the block's end goes to ``on_error`` (outside it, this raises).

        Raises
        ------
        dgr.errors.WorkerUnavailable
            The next stage (or the loop's first) cannot be reached.
        """
        h = step.header
        if not h.reply_to:
            self.send_back(conn, "", *reply(step, buf))
        elif not self.is_last:
            self.relay(step, buf, on_error)
        else:
            toks = step.tokens
            left = h.steps - len(toks) if toks else 0  # tokens the loop still makes
            loop = h.steps > 1 and left > 0 and (h.stop_tokens is None
                                                 or toks[-1] not in h.stop_tokens)
            drafts: list[int] = []
            if loop and h.speculate and self.speculator is not None:
                drafts = self.speculator.draft(h, step.lease.slot, toks[-1], left)
            # the loop step first, so stage 1 starts at once; but when this worker is
            # stage 1 too, the next step runs here on another thread and its reply must
            # not overtake this one: reply first then
            if loop and not self.is_first:
                self.next_lap(h, toks, drafts, left, on_error)
            self.send_back(conn, h.reply_to, *reply(step, buf))
            if loop and self.is_first:
                self.next_lap(h, toks, drafts, left, on_error)

    def relay(self, step: Step, buf: bytearray, on_error=None) -> None:
        """Forward this stage's boundary to the next stage named by ``Forward.relay``."""
        h = step.header
        # the same step for the next range: every other field (positions, want, rows,
        # sampling, reply_to, the decode loop's) travels on as it came; the encoder refills
        # the payload fields from the boundary
        codec = h.codec if step.array is not None else "raw"
        head, payload = self.frames.relay(h, step.result[:h.n_tokens], self.layer_end, codec,
                                          buf)
        self.links.send(h.relay[0].endpoint, head, payload, on_error)

    def next_lap(self, h: wire.Forward, emitted: list[int], drafts: list[int], left: int,
                 on_error=None) -> None:
        """Decode loop (``Forward.steps``): feed the last token ``h``'s step made to the
        first stage (``loop[0]``) as the next step, without a round trip to the driver, with
        ``drafts`` after it; it drops the drafts of ``h`` that were rejected (``rollback``).
        ``left``: the tokens the loop still makes."""
        first = h.loop[0]
        # ``h``'s input up to its last accepted draft stays; the last token emitted goes next
        pos = h.first_pos + h.n_tokens - h.drafts + len(emitted) - 1
        sampling = h.sampling
        if sampling is not None and sampling.grammar:  # this stage keeps it: its id suffices
            sampling = msgspec.structs.replace(sampling, grammar="")
        nh = wire.Forward(model=h.model, session=h.session, epoch=h.epoch,
                          first_pos=pos, n_tokens=1 + len(drafts), layer=0,
                          tokens=[emitted[-1], *drafts], want=h.want, sampling=sampling,
                          relay=h.loop[1:], reply_to=h.reply_to, loop=h.loop, steps=left,
                          stop_tokens=h.stop_tokens, solo=h.solo,
                          rollback=h.first_pos + h.n_tokens - pos, drafts=len(drafts),
                          speculate=h.speculate, max_draft=h.max_draft)
        self.links.send(first.endpoint, self.frames.encode(nh), None, on_error)

    def close(self) -> None:
        self.links.close()
