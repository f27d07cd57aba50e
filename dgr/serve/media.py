"""Images and audio in a chat request (docs/serve.md "Images and audio").

Every API's media reach the chat pipeline as OpenAI content parts (``dgr.serve.anthropic``
and ``dgr.serve.responses`` convert theirs): ``image_url`` (a ``data:`` URL, or an
``http(s)`` one only where the operator's allowlist names its host) and ``input_audio``
(base64 wav or mp3). As llama-server does, each part becomes a text part holding the
projector's media marker, the template renders the text, and the projector beside the first
stage cuts and encodes it with the files (``AsyncRoute.encode_media``, libmtmd).

Everything is checked before a slot is taken, each a 400 naming the part: the count and the
bytes of the media (``max_media``, ``max_media_bytes``), base64 that does not decode, a format
the decoder does not read (sniffed from the bytes, not the declared type), an image where the
projector takes none (or audio), text that holds the marker itself; the projector refuses an
image whose header claims more than ``max_image_pixels`` before it decodes it, and a file it
cannot decode. No request makes the server fetch from an address the request chose: a URL is
fetched only from an allowlisted host, without redirects, within a timeout and the byte cap.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

import anyio

from dgr import errors
from dgr.driver.media import prompt_cells, prompt_keys, uncarried
from dgr.serve.api_errors import ApiError

log = logging.getLogger("dgr.serve")

__all__ = ["MediaPrompt", "MediaRequest", "has_media", "load", "request_media", "sniff",
           "take_media"]

#: image formats the projector's decoder (stb_image, in libmtmd) reads, by their magic bytes
IMAGE_FORMATS = {"jpeg": (b"\xff\xd8\xff",), "png": (b"\x89PNG\r\n\x1a\n",),
                 "gif": (b"GIF87a", b"GIF89a"), "bmp": (b"BM",)}
#: formats clients send that it does not read: named in the refusal
UNREAD = {"webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP",
          "tiff": lambda b: b[:4] in (b"II*\x00", b"MM\x00*"),
          "heic/avif": lambda b: b[4:8] == b"ftyp",
          "pdf": lambda b: b[:5] == b"%PDF-",
          "svg": lambda b: b.lstrip()[:5] in (b"<?xml", b"<svg ")}
#: the parts that carry media
PARTS = ("image_url", "input_audio")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[^;,]*)*)(;base64)?,(.*)\Z",
                       re.DOTALL)


def sniff(data: bytes) -> str:
    """The file's format from its first bytes: an image format of ``IMAGE_FORMATS``, ``wav``,
    ``mp3`` or ``flac`` (the audio libmtmd decodes), one of ``UNREAD``, or ``""``."""
    for name, magics in IMAGE_FORMATS.items():
        if any(data.startswith(m) for m in magics):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    if data[:4] == b"fLaC":
        return "flac"
    return next((name for name, test in UNREAD.items() if test(data)), "")


def has_media(messages: Any) -> bool:
    """Whether any message's content holds a media part."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in PARTS for p in m["content"])
        for m in messages)


@dataclass(frozen=True)
class MediaRequest:
    """A request's media, in marker order: each ``(kind, bytes or None, url or None,
    where)``, a URL's bytes fetched by ``load``."""

    items: list


def take_media(messages: list, marker: str, *, max_media: int, max_bytes: int,
               url_hosts: Sequence[str] = ()) -> tuple[list, MediaRequest]:
    """``messages`` with each media part a text part of ``marker``, and the media.

    Raises ``ApiError`` 400 for a part that is not well formed, more than ``max_media``
    parts, an item larger than ``max_bytes``, a URL that is not a ``data:`` URL or an
    ``http(s)`` one of a host in ``url_hosts``, or text that holds ``marker``."""
    out, items = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and marker in content:
            raise _marker(f"messages[{i}].content", marker)
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str) and marker in p["text"]:
                raise _marker(where, marker)
            if kind not in PARTS:
                parts.append(p)
                continue
            if len(items) == max_media:
                raise ApiError(400, f"{where}: a request may hold at most {max_media} images "
                                    "or audio clips (--max-media)", param="messages",
                               code="too_many_media")
            items.append(_item(p, kind, where, max_bytes, url_hosts))
            parts.append({"type": "text", "text": marker})
        out.append({**m, "content": parts})
    return out, MediaRequest(items)


def request_media(route, model: str, messages: Any, settings) -> tuple[Any, MediaRequest | None]:
    """``take_media`` of a chat request's ``messages`` on ``route`` under the front's
    ``settings`` (``ServeSettings``): ``(messages, None)`` for a request without media; a 400
    where the route takes none: no projector beside its first stage, a recurrent or hybrid
    model's split (its state snapshots are per chunk of token ids: not carried yet), a stage
    older than wire schema 6, or a kind its projector does not take."""
    if not has_media(messages):
        return messages, None
    first = getattr(route, "media_stage", None) or route.stages[0]
    if not getattr(first, "media_marker", ""):
        raise ApiError(400, f"the model '{model}' takes no images or audio here: its route "
                            "has no projector (start the server with --mmproj, the model's "
                            "mmproj GGUF)", param="messages", code="no_projector")
    if any(getattr(st, "rollback_window", -1) == 0 for st in route.stages):
        raise ApiError(400, f"images on a split of '{model}' (a recurrent or hybrid model) "
                            "are not carried yet", param="messages",
                       code="unsupported_media")
    if any(st.wire_schema_version < 6 for st in route.stages):
        raise ApiError(400, "a stage of this route speaks a wire schema older than 6, which "
                            "carries no media steps", param="messages", code="unsupported_media")
    messages, media = take_media(messages, first.media_marker, max_media=settings.max_media,
                                 max_bytes=settings.max_media_bytes,
                                 url_hosts=settings.media_url_hosts)
    for kind, _, _, where in media.items:
        if not getattr(first, "media_vision" if kind == "image" else "media_audio", False):
            raise ApiError(400, f"{where}: the projector of '{model}' takes no "
                                f"{'images' if kind == 'image' else 'audio'}", param="messages",
                           code="unsupported_media")
    return messages, media


def _marker(where: str, marker: str) -> ApiError:
    return ApiError(400, f"{where}: the text holds {marker!r}, the projector's media marker, "
                         "which only an image or audio part may put there", param="messages")


def _item(p: dict, kind: str, where: str, max_bytes: int, url_hosts: Sequence[str]) -> tuple:
    if kind == "input_audio":
        a = p.get("input_audio")
        if not isinstance(a, dict) or not isinstance(a.get("data"), str) or \
                a.get("format") not in ("wav", "mp3"):
            raise ApiError(400, f"{where}: an input_audio part is {{'input_audio': {{'data': "
                                "base64, 'format': 'wav' | 'mp3'}}}}", param="messages")
        data = _b64(a["data"], f"{where}.input_audio.data", max_bytes)
        got = sniff(data)
        if got != a["format"]:
            what = got or "no format this server reads"
            raise ApiError(400, f"{where}: the audio's bytes are {what}, not {a['format']}",
                           param="messages", code="unsupported_media_type")
        return ("audio", data, None, where)
    v = p.get("image_url")
    url = v.get("url") if isinstance(v, dict) else v
    detail = v.get("detail", "auto") if isinstance(v, dict) else "auto"
    if not isinstance(url, str) or detail not in ("auto", "low", "high"):
        raise ApiError(400, f"{where}: an image_url part is {{'image_url': {{'url': ..., "
                            "'detail': 'auto' | 'low' | 'high'}}}}", param="messages")
    if url.startswith("data:"):
        d = _DATA_URL.match(url)
        if d is None or not d.group(3):
            raise ApiError(400, f"{where}: a data URL must be base64 "
                                "('data:image/png;base64,...')", param="messages")
        data = _b64(d.group(4), f"{where}.image_url.url", max_bytes)
        return ("image", _image(data, where), None, where)
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise ApiError(400, f"{where}: an image URL is a data: URL (or an http(s) URL of a host "
                            "the server allows)", param="messages", code="invalid_image_url")
    if (u.hostname or "").lower() not in url_hosts:
        raise ApiError(400, f"{where}: this server fetches no image from {u.hostname or url!r}"
                            ": send the image inline as a data: URL (base64), or ask the "
                            "operator to allow the host (--media-url-host)", param="messages",
                       code="image_url_not_allowed")
    return ("image", None, url, where)


def _b64(text: str, where: str, max_bytes: int) -> bytes:
    text = "".join(text.split())
    if len(text) // 4 * 3 > max_bytes:
        raise _too_large(where, len(text) // 4 * 3, max_bytes)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where} is not valid base64", param="messages") from None


def _too_large(where: str, n: int, max_bytes: int) -> ApiError:
    return ApiError(400, f"{where}: {n} bytes, more than the {max_bytes} an image or audio clip "
                         "may have (--max-media-bytes)", param="messages",
                    code="media_too_large")


def _image(data: bytes, where: str) -> bytes:
    got = sniff(data)
    if got not in IMAGE_FORMATS:
        what = f"a {got} file" if got else "no image format this server reads"
        raise ApiError(400, f"{where}: the image is {what}; send JPEG, PNG, GIF or BMP",
                       param="messages", code="unsupported_media_type")
    return data


async def load(media: MediaRequest, *, max_bytes: int, timeout: float) -> list[bytes]:
    """Each item's bytes, the allowlisted URLs fetched (on a thread; no redirects; at most
    ``max_bytes``; a 400 naming the part for anything that fails)."""
    out = []
    for kind, data, url, where in media.items:
        if data is None:
            data = _image(await anyio.to_thread.run_sync(_fetch, url, where, max_bytes, timeout),
                          where)
        out.append(data)
    return out


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: PLR0913
        return None  # a redirect is an error: it could name any address


def _fetch(url: str, where: str, max_bytes: int, timeout: float) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "dgr"}),
                         timeout=timeout) as r:
            data = r.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        e.close()  # its response (a redirect's too) holds the connection
        raise ApiError(400, f"{where}: fetching the image answered HTTP {e.code}",
                       param="messages", code="image_url_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ApiError(400, f"{where}: the image could not be fetched ({reason})",
                       param="messages", code="image_url_failed") from None
    if len(data) > max_bytes:
        raise _too_large(where, len(data), max_bytes)
    return data


@dataclass
class MediaPrompt:
    """A chat prompt with media: its rendered ``text`` (one marker per file), the ``files``,
    and its chunks as the projector cut them (``AsyncRoute.encode_media``, not encoded):
    each position's key (``keys``: what a kept session's history is matched with) and the
    cache cells it fills (``cells``: what counts against the context and in ``usage``)."""

    text: str
    files: list
    add_special: bool
    max_pixels: int
    chunks: list

    @property
    def keys(self) -> list:
        return prompt_keys(self.chunks)

    @property
    def cells(self) -> int:
        return prompt_cells(self.chunks)

    def cells_before(self, pos: int) -> int:
        """The cells of the prompt's first ``pos`` positions (never inside a media chunk)."""
        n, p = 0, 0
        for c in self.chunks:
            span = len(c) if isinstance(c, list) else c.span
            if p + span > pos:
                return n + (pos - p if isinstance(c, list) else 0)
            n += len(c) if isinstance(c, list) else c.n_rows
            p += span
        return n

    async def encoded(self, route, encode_from: int) -> list:
        """The chunks again, the media ones from position ``encode_from`` on encoded (the
        rest a session keeps)."""
        return await route.encode_media(self.text, self.files, add_special=self.add_special,
                                        parse_special=True, encode_from=encode_from,
                                        max_pixels=self.max_pixels)

    @classmethod
    async def cut(cls, route, media: MediaRequest, text: str, add_special: bool,
                  settings) -> MediaPrompt:
        """The rendered ``text``'s chunks with ``media``'s files (the allowed URLs fetched),
        none encoded: every file checked and decoded by the projector, before a slot."""
        files = await load(media, max_bytes=settings.max_media_bytes,
                           timeout=settings.media_url_timeout)
        try:
            chunks = await route.encode_media(text, files, add_special=add_special,
                                              parse_special=True, encode_from=1 << 31,
                                              max_pixels=settings.max_image_pixels)
        except errors.InvalidArgument as e:
            # the projector's own words on a file ("media item i ..."), which name no path;
            # anything else goes to the log
            msg = str(e).split("\n")[0]
            if not msg.startswith("media item "):
                log.warning("the projector refused a request's media: %s", e)
                msg = "the projector could not read the media"
            k = msg.split(" ", 3)[2] if msg.startswith("media item ") else ""
            where = media.items[int(k)][3] + ": " if k.isdigit() and \
                int(k) < len(media.items) else ""
            raise ApiError(400, where + msg, param="messages", code="invalid_media") from None
        for c in chunks:  # a split that cannot carry the rows says so before a slot
            why = uncarried(route.stages, getattr(c, "width", 0))
            if why:
                raise ApiError(400, why, param="messages", code="unsupported_media")
        return cls(text, files, add_special, settings.max_image_pixels,
                   [list(c) if not hasattr(c, "span") else c for c in chunks])
