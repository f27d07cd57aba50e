"""How a front serves: ``ServeSettings``, one typed table of every setting of ``create_app``.

``create_app`` takes it (``settings=``) or its fields as keywords; ``python -m dgr serve``
builds it from its flags (``ServeSettings.from_args``, ``SERVE_FLAGS``). The objects a front
is given (its route, chat template, API keys, metrics registry) are arguments of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr.errors import InvalidArgument
from dgr.protocol.config import SettingsTable
from dgr.protocol.embeddings import POOLING

__all__ = ["ServeSettings", "SERVE_FLAGS"]


#: each setting ``python -m dgr serve`` sets, from its parsed flags (the pooling's default,
#: the GGUF's own, is the command's to find: it passes ``pooling`` itself when unset)
SERVE_FLAGS = {
    "queue_timeout": ("queue_timeout", lambda a: a.queue_timeout),
    "max_queue": ("max_queue", lambda a: a.max_queue),
    "max_per_key": ("max_requests_per_key", lambda a: a.max_requests_per_key),
    "prompt_cache": ("prompt_cache", lambda a: a.prompt_cache),
    "prompt_cache_ttl": ("prompt_cache_ttl", lambda a: a.prompt_cache_ttl),
    "prefix_store": ("prefix_store", lambda a: a.prefix_store),
    "pooling": ("pooling", lambda a: a.pooling or "last"),
    "max_media": ("max_media", lambda a: a.max_media),
    "max_media_bytes": ("max_media_bytes", lambda a: a.max_media_bytes),
    "max_image_pixels": ("max_image_pixels", lambda a: a.max_image_pixels),
    "media_url_hosts": ("media_url_host",
                        lambda a: tuple(h.strip().lower() for v in a.media_url_host or ()
                                        for h in v.split(",") if h.strip())),
}


@dataclass(frozen=True, kw_only=True)
class ServeSettings(SettingsTable):
    """A front's settings, checked when made (``dgr.errors.InvalidArgument``, a
    ``ValueError``, naming the setting).

    Attributes
    ----------
    queue_timeout : float
        Seconds a request may wait in the queue for its slots before a 503 with
        ``Retry-After`` (long: an agent's sub-agents queue behind each other).
    max_queue : int
        Requests that may wait for slots at once, in arrival order; one more gets a 429 with
        ``Retry-After`` at once (0: no queue, every slot busy is a 429).
    max_per_key : int or None
        The requests (chat, completions, messages, responses, embeddings) one API key may
        have in flight, from arrival until the response or stream ends, however it ends; one
        more gets a 429 at once. None: ``per_key_default`` of the route's slots; 0: no cap.
        Without API keys there is no key to count, and no cap.
    prompt_cache : int
        How many ended sessions the front keeps, caches and all, for later requests of the
        same API key whose prompts begin the same way (``dgr.serve.prefix``; 0: none); each
        holds a slot until a request needs it or it is ``prompt_cache_ttl`` seconds idle.
    prompt_cache_ttl : float
        Seconds a kept session may stay idle.
    prefix_store : bool
        Whether the sessions the front closes after a request that ended well keep their
        caches in the stages' prefix stores (where every stage has one), and
        new sessions adopt them (``dgr.serve.prefix``): a reuse that outlives this front's
        sessions and the front itself.
    pooling : str
        How ``/v1/embeddings`` pools a prompt's rows (``mean``, ``last``, ``cls``:
        ``dgr.protocol.embeddings``).
    normalize : bool
        Whether ``/v1/embeddings`` scales each vector to unit length.
    max_media : int
        The images and audio clips one chat request may hold (a route whose first stage has
        a projector, ``--mmproj``; ``dgr.serve.media``).
    max_media_bytes : int
        The bytes one image or audio clip may have (decoded from base64, or fetched).
    max_image_pixels : int
        The pixels (width x height) an image may have, read from its header before it is
        decoded (the first stage's own cap, ``dgr.worker.worker.MAX_PIXELS``, also holds).
    media_url_hosts : tuple of str
        The hosts whose ``http(s)`` image URLs the front fetches (lower case); any other
        URL but a ``data:`` one is a 400 (no request makes the server fetch from an address
        it chose).
    media_url_timeout : float
        Seconds a fetch of an allowed image URL may take.
    """

    KIND = "front"
    FLAGS = SERVE_FLAGS

    queue_timeout: float = 600.0
    max_queue: int = 128
    max_per_key: int | None = None
    prompt_cache: int = 0
    prompt_cache_ttl: float = 30.0
    prefix_store: bool = True
    pooling: str = "last"
    normalize: bool = True
    max_media: int = 8
    max_media_bytes: int = 5 << 20
    max_image_pixels: int = 8000 * 8000
    media_url_hosts: tuple = ()
    media_url_timeout: float = 10.0

    def __post_init__(self):
        if self.max_media < 0 or self.max_media_bytes < 1 or self.max_image_pixels < 1 or \
                not self.media_url_timeout > 0:
            raise InvalidArgument(
                f"max_media must be >= 0, max_media_bytes and max_image_pixels >= 1 and "
                f"media_url_timeout > 0, got {self.max_media}, {self.max_media_bytes}, "
                f"{self.max_image_pixels} and {self.media_url_timeout}")
        object.__setattr__(self, "media_url_hosts",
                           tuple(str(h).lower() for h in self.media_url_hosts))
        if self.pooling not in POOLING:
            raise InvalidArgument(f"unknown pooling {self.pooling!r} (known: {', '.join(POOLING)})")
        if self.prompt_cache < 0 or not self.prompt_cache_ttl > 0:
            raise InvalidArgument(f"the prompt cache's size must be >= 0 and its ttl > 0, got "
                             f"{self.prompt_cache} and {self.prompt_cache_ttl}")
        if self.max_per_key is not None and self.max_per_key < 0:
            raise InvalidArgument(f"max_per_key must be >= 0, got {self.max_per_key}")
        if self.max_queue < 0:
            raise InvalidArgument(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.queue_timeout >= 0:
            raise InvalidArgument(f"queue_timeout must be >= 0, got {self.queue_timeout}")
