"""The CLI's text stream (``dgr.cli._stream``): a character whose UTF-8 bytes are cut across
tokens is printed whole once its last byte arrives, never as U+FFFD (no model needed: a
byte-level tokenizer stands in for SmolLM2's)."""

from __future__ import annotations

import argparse
import sys

import pytest

from dgr.cli import commands as cli

FFFD = "\ufffd"
SO, RE, FROG = "そ".encode(), "れ".encode(), "🐸".encode()  # 3, 3 and 4 bytes
# token id -> bytes: whole characters, cuts after 1, 2 and 3 bytes, and one token that ends a
# character and starts the next
VOCAB = [b"A", SO[:2], SO[2:], RE[:1], RE[1:], FROG[:1], FROG[1:3], FROG[3:] + b" ",
         SO[2:] + b"!" + RE[:2], RE[2:], b"\n"]


def detok(tokens) -> str:
    """Like ``dgr.Engine.detokenize``: the tokens' bytes, decoded with replacement."""
    return b"".join(VOCAB[t] for t in tokens).decode("utf-8", "replace")


class Writes:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass


class Clock:
    """``time`` for the CLI: each reading is a second later, so every token passes the
    20-a-second display throttle (the test sees every decision to print)."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t


class Session:
    stop_reason = "length"

    def __init__(self, tokens):
        self.tokens = tokens

    def generate(self, prompt, **kw):
        yield from self.tokens


class FakeRoute:
    def __init__(self, tokens):
        self.tokens = tokens

    def session(self):
        return Session(self.tokens)


def stream(monkeypatch, tokens, clock=None):
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(cli, "time", clock or Clock())
    args = argparse.Namespace(max_tokens=len(tokens), temperature=0.0, top_k=0, top_p=1.0,
                              seed=0, stop=[], parity=False, min_p=0.0, repeat_penalty=1.0,
                              presence_penalty=0.0, frequency_penalty=0.0, repeat_last_n=64)
    _, got, *_ = cli._stream(FakeRoute(tokens), args, [0], detok)
    assert got == tokens
    return out.parts


TOKENS = [0, 1, 2, 0, 3, 4, 5, 6, 7, 1, 8, 9, 10, 0]


def test_tokens_cut_characters():
    # the fixture really cuts characters: some prefixes end inside one
    cut = [k for k in range(1, len(TOKENS)) if detok(TOKENS[:k]).endswith(FFFD)]
    assert cut == [2, 5, 7, 8, 10, 11]  # 2 of 3 bytes, 1 of 3, 1 of 4, 3 of 4, ...
    assert FFFD not in detok(TOKENS)


def test_split_characters_are_printed_whole(monkeypatch):
    parts = stream(monkeypatch, TOKENS)
    full = detok(TOKENS)
    assert "".join(parts) == full + "\n"
    assert all(FFFD not in p for p in parts), parts
    # printed as soon as the text ends on a whole character: after each such token
    shown, want = "", []
    for k in range(1, len(TOKENS) + 1):
        text = detok(TOKENS[:k])
        if not text.endswith(FFFD) and text != shown:
            want.append(text[len(shown):])
            shown = text
    want.append("\n")  # the end of the line (everything was shown already)
    assert [p for p in parts if p] == want


@pytest.mark.parametrize("tail", [[1], [5], [5, 6]], ids=["2-of-3-bytes", "1-of-4", "3-of-4"])
def test_output_ending_inside_a_character_holds_it_back_to_the_end(monkeypatch, tail):
    # the generation stops before the character's last byte: nothing but the final write
    # (which ends the line) comes after "A"
    parts = stream(monkeypatch, [0, *tail])
    assert parts[:-1] == ["A"] and parts[-1].endswith("\n"), parts
