"""Constrained decoding: a grammar masks the tokens the last stage may sample.

The engine is llguidance (a kept library made for LLM decoding: a token mask costs about
0.1 ms on a 49k or a 262k vocabulary, docs/structured.md). A request's grammar is
llguidance's grammar definition (``compile_grammar`` makes one from a JSON schema, a GBNF or
Lark grammar, or a regex). ``Constraint`` follows one sequence: it masks the row that samples
the token at position ``q`` with the grammar's state after the tokens from ``start`` (the
first constrained position: the prompt's length) to ``q``, consuming or rolling back tokens
to get there, so rejected drafts are rolled back and a re-prefill catches up.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Callable, Sequence

import numpy as np

from dgr.errors import InvalidArgument

__all__ = ["compile_grammar", "grammar_id", "Vocabulary", "Constraint", "GRAMMAR_FORMATS"]

#: what ``compile_grammar`` takes: llguidance's formats
GRAMMAR_FORMATS = ("json_schema", "gbnf", "lark", "regex")
#: the JSON a schema's grammar allows: compact, with a space after "," and ":"
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of dgr
        raise InvalidArgument(f"constrained decoding needs llguidance ({e})") from None
    return llguidance


def compile_grammar(fmt: str, text: str | dict) -> str:
    """llguidance's grammar definition of ``text`` in ``fmt`` (``GRAMMAR_FORMATS``),
    checked: a bad schema or grammar is ``InvalidArgument`` with llguidance's reason."""
    llg = _llg()
    if fmt not in GRAMMAR_FORMATS:
        raise InvalidArgument(f"grammar format must be one of {GRAMMAR_FORMATS}, got {fmt!r}")
    if fmt == "json_schema" and not isinstance(text, str):
        text = json.dumps(text)
    try:
        if fmt == "json_schema":
            # one layout: ", " and ": ", no other whitespace (a model cannot pad its
            # output with blank lines until max_tokens); a schema's "x-guidance" overrides
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        else:
            grammar = llg.grammar_from(fmt, text)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"the {fmt} is not valid: {e}") from None
    is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidArgument(f"the {fmt} is not valid: {msgs[0] if msgs else 'rejected'}")
    return grammar


def grammar_id(grammar: str) -> int:
    """A grammar's 64-bit id (nonzero): what later steps name it by."""
    return int.from_bytes(hashlib.blake2b(grammar.encode(), digest_size=8).digest(),
                          "little") or 1


class Vocabulary:
    """llguidance's view of a model's vocabulary, built once per process from an engine
    (``token_pieces``, ``tokenize``, ``is_eog``): about 0.3 s for 49k tokens, 2 s for 262k.
    Thread-safe; the tokenizer is built on first use."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._tok = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                self._tok = self._build()
            return self._tok

    def _build(self):
        llg = _llg()
        e = self._engine
        special = e.token_pieces(special=True)
        plain = e.token_pieces()
        # a control token renders empty unless asked for: llguidance marks it with 0xff
        tokens = [b"\xff" + s if not p and s else s for p, s in zip(plain, special)]
        eog = [t for t in range(len(tokens)) if e.is_eog(t)]

        class Wrapped:
            eos_token_id = eog[0] if eog else 0
            bos_token_id = None
            special_token_ids = [t for t, (p, s) in enumerate(zip(plain, special))
                                 if not p and s]

            def __init__(self):
                self.tokens = tokens

            def __call__(self, text: bytes) -> list[int]:
                return [int(x) for x in e.tokenize(text, False, False)]

        return llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()), eos_token=eog or None)


class Constraint:
    """One sequence's grammar state: masks rows by position (docstring of the module).

    ``tokens_before(a, b)``: the sequence's tokens at positions ``a`` .. ``b - 1`` (to catch
    up after a re-prefill or a step that skipped this stage's masks).
    """

    def __init__(self, vocab: Vocabulary, grammar: str, start: int):
        llg = _llg()
        self.vocab = vocab
        self.matcher = llg.LLMatcher(vocab.tokenizer, grammar)
        if self.matcher.is_error():
            raise InvalidArgument(f"the grammar is not valid: {self.matcher.get_error()}")
        self.start = int(start)
        self.pos = self.start  # the position of the next token the matcher expects
        self._words = (vocab.tokenizer.vocab_size + 31) // 32
        self._mask = np.zeros(self._words, dtype=np.int32)

    def seek(self, pos: int, tokens_before: Callable[[int, int], Sequence[int]]) -> bool:
        """Bring the state to the one before the token at ``pos``; False when a token on
        the way does not fit the grammar (the rows past it cannot be used)."""
        if pos < self.start:
            raise InvalidArgument(f"a grammar step samples position {pos}, before the "
                                  f"grammar's start {self.start}")
        if pos < self.pos:
            if not self.matcher.rollback(self.pos - pos):
                raise InvalidArgument(f"the grammar cannot roll back {self.pos - pos} tokens")
            self.pos = pos
        if pos > self.pos:
            toks = [int(t) for t in tokens_before(self.pos, pos)]
            if len(toks) != pos - self.pos:
                raise InvalidArgument("the grammar lacks the sequence's tokens to catch up")
            # a token that does not fit (a draft) is not consumed: the state stays usable
            n = self.matcher.try_consume_tokens(toks)
            self.pos += n
            if n < len(toks):
                return False
        return not self.matcher.is_error()

    def mask(self, row: np.ndarray) -> np.ndarray:
        """``row`` with every token the grammar does not allow now at ``-inf`` (a copy)."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if m.is_error():
            raise InvalidArgument(f"the grammar failed: {m.get_error()}")
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        n = row.shape[-1]
        allowed = bits[:n].astype(bool)
        if n > bits.size:
            allowed = np.concatenate([allowed, np.zeros(n - bits.size, dtype=bool)])
        out = np.array(row, dtype=np.float32, copy=True)
        out[~allowed] = -np.inf
        return out
