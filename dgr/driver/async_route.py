"""``AsyncRoute``: a route over running workers (asyncio): its stages and clients, its data
links, step deadlines and recovery policy; sessions run on it (``dgr.driver.session``).

A route is an ordered list of shard workers that together cover every layer of one model with
identical numeric settings. The driver tokenizes (through the first worker, or a local
tokenizer), prefills in chunks of at most ``n_ubatch`` tokens, relays each step's boundary
from stage to stage, has the last stage sample (or return logits), and streams tokens. It
keeps the token history and the step composition, so when a worker loses the session (cache
miss, unknown session, restart, deadline) it raises the epoch, replays the history exactly as
it was first computed and carries on: the generation's tokens are the same as without the
failure.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Sequence

import numpy as np

from dgr import errors
from dgr.driver.checks import check_route
from dgr.driver.config import RouteConfig
from dgr.driver.deadlines import Deadlines
from dgr.driver.links import RelayLinks
from dgr.driver.media import MediaRef, MediaStep
from dgr.driver.provider import RouteProvider, StaticPool, parse_endpoints
from dgr.driver.recovery import Recovery
from dgr.driver.results import Generation
from dgr.driver.session import AsyncRouteSession
from dgr.driver.tokenizers import LocalTokenizer, RemoteTokenizer
from dgr.protocol import prefix, wire
from dgr.protocol.describe import StageInfo
from dgr.transport.client import ShardClient
from dgr.transport.common import MAX_PIECES
from dgr.transport.dataplane import AsyncLink
from dgr.transport.security import Security, default_security

log = logging.getLogger("dgr.driver.route")

#: architectures whose boundary row may carry integers (cache cell indices: the last
#: full-indexer layer's selection) beside the residual: only the raw codec keeps them (patches
#: 0021, 0022; refused whether or not a model's layers share an indexer, which only its stages
#: know)
INDEX_SIDEBANDS = frozenset({"glm-dsa", "hy_v4", "glm5-next"})

__all__ = ["AsyncRoute"]


class AsyncRoute:
    """A route over running workers, asyncio API (``Route`` is the blocking one).

    Parameters
    ----------
    endpoints : str or sequence of str
        ``host:port`` of each stage, in any order (they are ordered by layer range).
    config : dgr.driver.config.RouteConfig, optional
        The route's settings (timeouts, codec, relay, the decode loop, batching, speculative
        decoding, recovery), each documented there; ``**settings`` changes some of them
        (``AsyncRoute(endpoints, relay=False)``), and an unknown one is ``InvalidArgument``.
        The settings are the attributes of the same names.
    tokenizer : object, optional
        Anything with ``tokenize(text, add_special, parse_special)`` and
        ``detokenize(tokens)`` (e.g. a local ``dgr.Engine`` of the same model). Default: the
        first worker's tokenizer, over its control RPCs.
    provider : dgr.driver.RouteProvider, optional
        Where replacements for a failed stage come from (and where failures are reported).
        Default: a ``StaticPool`` of ``endpoints`` plus the config's ``spares``. Without
        ``endpoints`` the first route comes from ``provider.route()``.
    security : dgr.transport.security.Security, optional
        The cluster credential presented to the workers and TLS, on both planes
        (docs/security.md). None: ``default_security()``, read from ``DGR_CLUSTER_KEY_FILE``,
        ``DGR_TLS_CA``, ``DGR_TLS_CERT`` and ``DGR_TLS_KEY`` (unset: none, plaintext).
    """

    def __init__(self, endpoints: str | Sequence[str] | None = None, *,
                 config: RouteConfig | None = None, tokenizer: Any = None,
                 provider: RouteProvider | None = None, security: Security | None = None,
                 **settings: Any):
        c = self.config = (config or RouteConfig()).with_(**settings)
        if endpoints is None and provider is None:
            raise errors.RouteError("a route needs endpoints or a provider")
        self.endpoints = parse_endpoints(endpoints) if endpoints is not None else []
        self.provider = provider if provider is not None else StaticPool(
            self.endpoints + parse_endpoints(list(c.spares)) if c.spares else self.endpoints)
        self.timeout = c.timeout
        self.connect_timeout = c.connect_timeout
        self.codec = c.codec
        self.compress = c.compress
        self.max_retries = c.max_retries
        self.probe_timeout = c.probe_timeout
        self.backoff = c.backoff
        self._tokenizer_arg = tokenizer
        self._pieces: list[bytes] | None = None  # the vocabulary's pieces (pieces())
        self.clients: list[ShardClient] = []
        self.stages: list[StageInfo] = []
        self.tokenizer: Any = None
        #: step deadlines sized from each stage's recent step times
        self.deadlines = Deadlines(c.step_timeout, c.deadline_floor, c.deadline_factor)
        #: the recovery policy: stage replacement, epoch bump and re-prefill
        self.recovery = Recovery(self)
        # direct relay (where it applies: checked again at connect): data links, replies
        # awaited by (session, epoch, first_pos)
        self._relay_arg = c.relay
        self.relay = c.relay_wanted
        self.route_id = uuid.uuid4().hex
        self.security = security if security is not None else default_security()
        self.relay_links = RelayLinks(self.route_id, lambda: self.stages, c.probe_timeout,
                                      self.security)
        self.loop = bool(c.loop)
        self.loop_window = int(c.loop_window)
        self.relay_steps = 0
        #: whether the stages may compute this route's steps in one forward with other
        #: sessions' (False: every step is ``Forward.solo``; the parity mode's steps always
        #: are: ``dgr.driver.headers.solo_of``)
        self.batching = bool(c.batching)
        #: the decode loop's drafter on the last stage ("": none) and its most drafts a trip
        self.speculate, self.max_draft = c.speculate, int(c.max_draft)
        #: whether stages may compute on different kinds of device (``check_route``)
        self.mixed_devices = bool(c.mixed_devices)
        #: the worker that encodes media (``config.encoder``; None: the first stage) and its
        #: describe
        self.encoder: ShardClient | None = None
        self._encoder_info: StageInfo | None = None

    # -- setup ---------------------------------------------------------------------------

    async def connect(self) -> AsyncRoute:
        """Describe every stage and check that together they form one route.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            A stage cannot be reached.
        dgr.errors.ModelMismatch, dgr.errors.RouteError, dgr.errors.WorkerDraining
            See ``check_route``.
        """
        if not self.endpoints:
            self.endpoints = parse_endpoints(await self.provider.route())
        if not self.clients:
            self.clients = [ShardClient(e, timeout=self.timeout, security=self.security)
                            for e in self.endpoints]
        # every describe ends before a failure is raised: none is left pending when the
        # caller closes the route (and its event loop)
        infos = await asyncio.gather(*(c.describe() for c in self.clients),
                                     return_exceptions=True)
        failed = next((e for e in infos if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
        order = check_route(infos, mixed_devices=self.mixed_devices)
        kinds = sorted({s.compute for s in order})
        if len(kinds) > 1:
            log.warning("a mixed route (%s): its bits differ from either whole model",
                        " + ".join(kinds))
            # a relayed frame names one stage identity for every hop, and the stages of a
            # mixed route have each their own: its steps go hop by hop
            if self._relay_arg:
                raise errors.RouteError(
                    "relay=True: a relayed frame carries one stage identity, and the stages of "
                    "a mixed route have each their own (their kind of device); use relay=None "
                    "or False")
            self.relay = False
        if self.codec != "raw" and any(s.arch in INDEX_SIDEBANDS for s in order[:-1]):
            # the boundary row carries cache cell indices (a top-k sideband): a lossy codec
            # would round them to other cells (docs/wire.md "Sidebands")
            raise errors.RouteError(
                f"codec={self.codec!r}: {order[0].arch}'s boundary carries the selection of its "
                "last full-indexer layer as cache cell indices, which a lossy codec would change; "
                "use codec='raw'")
        old = [s for s in order if s.wire_schema_version < 4]
        if self.speculate and old:
            # a stage before wire schema 4 would ignore Forward.rollback and drafts
            raise errors.RouteError(
                f"speculate={self.speculate!r} needs every stage on wire schema 4 or later; "
                + ", ".join(f"{s.endpoint} speaks {s.wire_schema_version}" for s in old))
        if self.speculate and self.speculate not in order[-1].drafters:
            raise errors.RouteError(
                f"speculate={self.speculate!r}: the last stage {order[-1].endpoint} drafts with "
                f"{', '.join(order[-1].drafters) or 'nothing'}"
                + (" (start it with --mtp, on a model with a NextN block)"
                   if self.speculate == "mtp" and order[-1].drafters else "")
                + ("" if order[-1].drafters else
                   " (a stage drafts nothing when its caches cannot roll a rejected draft back:"
                   " a recurrent or hybrid model's state keeps no history)"))
        by_ep = {c.endpoint: c for c in self.clients}
        self.stages = order
        self.clients = [by_ep[s.endpoint] for s in order]
        self.deadlines.reset(len(order))
        self.recovery.reset(len(order))
        if self._relay_arg is None:
            self.relay = self.relay and all(st.data_port for st in order)
            if self.relay:
                # every stage answered over gRPC just now: a data port that cannot be reached
                # (a firewall, a proxy that forwards gRPC only) means the gRPC path, not errors
                try:
                    await self.links()
                except errors.DgrError as e:
                    log.warning("direct relay unavailable (%s): steps go over gRPC", e)
                    self.relay = False
        if self.config.encoder:
            await self._connect_encoder(order[0])
        tok = self._tokenizer_arg
        self.tokenizer = LocalTokenizer(tok) if tok is not None else RemoteTokenizer(self)
        return self

    async def _connect_encoder(self, first: StageInfo) -> None:
        """Describe ``config.encoder``: a worker of the first stage's model, layers from 0,
        with a projector."""
        if self.encoder is None:
            self.encoder = ShardClient(self.config.encoder, timeout=self.timeout,
                                       security=self.security)
        info = await self.encoder.describe()
        if info.model_identity != first.model_identity or not info.is_first:
            raise errors.ModelMismatch(
                f"the encoder {info.endpoint} serves {info.model_identity} from layer "
                f"{info.layers[0]}; the route's first stage serves {first.model_identity} "
                "from layer 0")
        if not info.media_marker:
            raise errors.RouteError(f"the encoder {info.endpoint} has no projector: start it "
                                    "with --mmproj")
        self._encoder_info = info

    @property
    def media_stage(self) -> StageInfo | None:
        """The describe of the worker that encodes this route's media (its ``media_marker``,
        ``media_vision``, ``media_audio``): ``config.encoder``'s, else the first stage's."""
        return self._encoder_info or (self.stages[0] if self.stages else None)

    async def __aenter__(self) -> AsyncRoute:
        try:
            return await self.connect()
        except BaseException:  # a route that does not connect leaves no channel open
            await self.close()
            raise

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        links = self.relay_links.close()
        clients, self.clients = self.clients + self.recovery.retired, []
        if self.encoder is not None:
            clients, self.encoder = clients + [self.encoder], None
        self.recovery.retired = []
        await asyncio.gather(*(c.close() for c in clients), *(k.wait_closed() for k in links),
                             return_exceptions=True)

    # -- direct relay --------------------------------------------------------------------

    async def links(self) -> list[AsyncLink]:
        """Open data links to every stage (once; reopened after a loss); see
        ``RelayLinks.links``."""
        return await self.relay_links.links()

    def hops(self) -> list[wire.Hop]:
        """``Forward.relay`` of the current route (after ``links()``)."""
        return self.relay_links.hops()

    def loop_hops(self) -> list[wire.Hop]:
        """``Forward.loop`` of the current route: every stage, the first included."""
        return self.relay_links.loop_hops()

    # -- deadlines and failover ----------------------------------------------------------

    @property
    def step_timeout(self) -> float:
        """The longest deadline of one step on one stage, seconds."""
        return self.deadlines.step_timeout

    @property
    def deadline_floor(self) -> float:
        return self.deadlines.floor

    @property
    def deadline_factor(self) -> float:
        return self.deadlines.factor

    def deadline(self, i: int, n_tokens: int) -> float:
        """Deadline of an ``n_tokens`` step on stage ``i`` (``len(stages)``: a relayed step
        through the whole route), sized from its recent steps."""
        return self.deadlines.deadline(i, n_tokens)

    @property
    def replacements(self) -> list[tuple[tuple[int, int], str, str]]:
        """Stage replacements done by this route: (layers, old endpoint, new endpoint)."""
        return self.recovery.replacements

    async def unresponsive_stage(self) -> int | None:
        """The first stage that does not answer a describe within ``probe_timeout`` (None:
        all answer)."""
        return await self.recovery.unresponsive_stage()

    async def replace_stage(self, i: int, failed: ShardClient, err: BaseException) -> bool:
        """Replace stage ``i`` (its client ``failed`` failed with ``err``); see
        ``Recovery.replace_stage``."""
        return await self.recovery.replace_stage(i, failed, err)

    # -- facts ---------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """Model identity plus numeric settings: what every frame of this route names."""
        return self.stages[0].identity

    @property
    def n_ubatch(self) -> int:
        return int(self.stages[0].settings["n_ubatch"])

    @property
    def prefix_store(self) -> bool:
        """Whether every stage keeps ended sessions' caches for later ones (its describe
        record's ``prefix_store`` has a size): ``AsyncRouteSession.close(keep=True)`` and
        ``adopt`` use the stores then."""
        return bool(self.stages) and all(st.prefix_store.get("size", 0) > 0
                                         for st in self.stages)

    def prefix_salt(self, tenant: str | None) -> bytes:
        """The first input of this route's prefix keys for ``tenant``
        (``dgr.protocol.prefix.salt``: the stages' identities and layers, the chunk)."""
        return prefix.salt([f"{st.identity}/{st.layers[0]}-{st.layers[1]}"
                            for st in self.stages], self.n_ubatch, tenant)

    @property
    def eog_tokens(self) -> frozenset:
        return self.stages[-1].eog_tokens

    @property
    def settings(self) -> dict:
        return dict(self.stages[0].settings)

    @property
    def n_ctx(self) -> int:
        """Context tokens per session the route holds: the smallest of its stages' (each
        its ``--ctx``, or the one it chose for ``--ctx 0``)."""
        return min(int(st.n_ctx) for st in self.stages)

    async def describe(self) -> list[StageInfo]:
        """Fresh describe records of every stage, in route order."""
        return list(await asyncio.gather(*(c.describe() for c in self.clients)))

    # -- use -----------------------------------------------------------------------------

    def session(self, session_id: str | None = None, *,
                tenant: str | None = None) -> AsyncRouteSession:
        """A new route session (its id names it on every worker); ``tenant`` names whose
        prefixes it may reuse and keep (``AsyncRouteSession.adopt``, ``close(keep=True)``)."""
        if not self.stages:
            raise errors.RouteError("connect() the route first")
        return AsyncRouteSession(self, session_id or uuid.uuid4().hex, tenant=tenant)

    async def tokenize(self, text: str, add_special: bool = True,
                       parse_special: bool = False) -> np.ndarray:
        return await self.tokenizer.tokenize(text, add_special, parse_special)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return await self.tokenizer.detokenize(tokens)

    async def encode_media(self, prompt: str, media: Sequence[bytes], *,
                           add_special: bool = True, parse_special: bool = True,
                           first_pos: int = 0, encode_from: int = 0,
                           max_pixels: int = 0) -> list:
        """``prompt`` (one ``media_stage.media_marker`` per item of ``media``, each a file's
        bytes) cut and encoded by the projector beside the first stage (its ``--mmproj``, on
        its device), or by ``config.encoder``'s: a list of its chunks from ``first_pos`` on,
        each a text chunk's token ids or a ``dgr.driver.media.MediaStep``, for
        ``AsyncRouteSession.prefill_media`` / ``generate_media``; a media chunk that starts before ``encode_from`` is a
        ``MediaRef`` instead (not encoded: what a session that keeps it needs).
        ``max_pixels``: the most pixels an image may have (0: the worker's own cap,
        ``dgr.worker.worker.MAX_PIXELS``; the smaller holds).

        Raises
        ------
        dgr.errors.InvalidArgument
            The first stage has no projector, or it refused the media (not an image or audio
            file it decodes, one it does not take, an image too large, a marker count that is
            not the media's).
        """
        by = self.media_stage or self.stages[0]
        if not by.media_marker:
            raise errors.InvalidArgument(
                f"the first stage ({self.stages[0].endpoint}) has no projector: start it with "
                "--mmproj (the model's mmproj GGUF)")
        client = self.encoder or self.clients[0]
        got = await client.encode_media(prompt, media, add_special=add_special,
                                        parse_special=parse_special, first_pos=first_pos,
                                        encode_from=encode_from, max_pixels=max_pixels,
                                        timeout=self.step_timeout)
        return [c["tokens"] if c["kind"] == "text" else
                MediaStep(c["rows"], c["positions"], c["kind"], causal=not c["non_causal"],
                          id=c["id"]) if "rows" in c else
                MediaRef(c["kind"], c["id"], c["n_rows"], c["n_pos"], not c["non_causal"],
                         c["width"])
                for c in got]

    async def pieces(self) -> list[bytes]:
        """Every token id's bytes (``token_pieces``), fetched once and kept: what
        ``dgr.driver.text.TextStream`` builds a generation's text from."""
        if self._pieces is None:
            self._pieces = await self.token_pieces()
        return self._pieces

    async def token_pieces(self, first: int = 0, count: int | None = None) -> list[bytes]:
        """Each token id's bytes from ``first`` (``count`` ids, None: to the vocabulary's
        end) as llama.cpp renders it alone: a generation's text is their concatenation, as
        llama-server builds it (docs/serve.md). Fetched in pages of ``MAX_PIECES``."""
        n_vocab = int(self.stages[0].n_vocab)
        last = n_vocab if count is None else min(n_vocab, first + count)
        out: list[bytes] = []
        while first + len(out) < last:
            at = first + len(out)
            page = await self.tokenizer.token_pieces(at, min(MAX_PIECES, last - at))
            if not page:
                break
            out.extend(page)
        return out

    async def complete(self, prompt: str | Sequence[int], **kw) -> Generation:
        """Generate in a fresh session and release it; see ``AsyncRouteSession.complete``."""
        s = self.session()
        try:
            return await s.complete(prompt, **kw)
        finally:
            await s.close()
