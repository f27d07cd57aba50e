"""A generation's text, built one token at a time as llama-server builds it.

Each token's bytes (``llama_token_to_piece``, the route's ``token_pieces``) are appended and
decoded as UTF-8 incrementally: a character split across tokens waits for its last byte, and
bytes that can never form one become U+FFFD. Stop strings are searched in the new tail only.
A token costs the same at the 1st and the 10,000th: the token list is never detokenized again.
"""

from __future__ import annotations

import codecs
from typing import Sequence

__all__ = ["TextStream"]


class TextStream:
    """The text of a growing token list, and how much of it may be shown yet.

    ``pieces[t]``: token ``t``'s bytes. ``stops``: strings that end the text (the first one
    found cuts it, and it is never shown). ``push(token)`` returns the text that became
    visible: none of a tail that may still become a stop string. ``finish()`` returns the
    rest, once the generation ended.
    """

    def __init__(self, pieces: Sequence[bytes], stops: Sequence[str] = ()):
        self.pieces = pieces
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""  # decoded so far (up to the cut, once a stop string was found)
        self.shown = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string was found: ``text`` ends before it
        self.matched: str | None = None  # that stop string
        self._searched = 0  # stop strings were searched for in ``text[:_searched]``

    def push(self, token: int) -> str:
        """Append ``token``; the text that became visible (may be empty)."""
        if self.stopped:
            return ""
        self.text += self._decoder.decode(self.pieces[token])
        return self._visible(final=False)

    def finish(self) -> str:
        """The generation ended: the rest of the text (incomplete bytes become U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._visible(final=True)

    def _visible(self, *, final: bool) -> str:
        text = self.text
        if self.stops and not self.stopped:
            # a stop string that ends in the new text starts at most its length back
            start = max(0, self._searched - self._longest + 1)
            found = [(i, s) for s in self.stops for i in [text.find(s, start)] if i >= 0]
            self._searched = len(text)
            if found:
                cut, self.matched = min(found, key=lambda f: f[0])
                self.stopped = True
                self.text = text = text[:cut]
        end = len(text)
        if not final and not self.stopped:
            # hold a tail that is the start of a stop string: it may still become one
            end -= max((k for s in self.stops for k in range(min(len(s) - 1, end), 0, -1)
                        if text.endswith(s[:k])), default=0)
        piece = text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece
