"""dgr.driver.text.TextStream: a generation's text built per token, as llama-server does."""

from __future__ import annotations

import random

from dgr.driver.text import TextStream

# token ids: bytes of a small vocabulary, one of them a character split over two tokens
PIECES = [b"Hello", b" world", b"!", b"\xe4\xbd", b"\xa0", b" ST", b"OP", b"\n", b"", b"\xff"]


def stream(tokens, stops=()):
    t = TextStream(PIECES, stops)
    shown = [t.push(x) for x in tokens]
    shown.append(t.finish())
    return t, shown


def test_the_text_is_the_pieces_decoded_and_a_split_character_waits_for_its_last_byte():
    t, shown = stream([0, 1, 3, 4, 2])
    assert t.text == "Hello world你!" and "".join(shown) == t.text
    assert shown[2] == "" and shown[3] == "你"  # "你" is two tokens: shown once whole
    # bytes that never form a character become U+FFFD, and a control token is empty
    assert stream([0, 9, 8, 3])[0].text == "Hello\ufffd\ufffd"


def test_a_stop_string_cuts_the_text_and_is_never_shown_even_across_tokens():
    t, shown = stream([0, 5, 6, 1, 2], stops=["STOP"])
    assert t.stopped and t.text == "Hello " and "".join(shown) == "Hello "
    # " ST" may become "STOP": held, then shown once it does not
    t, shown = stream([0, 5, 1], stops=["STOP"])
    assert shown[:3] == ["Hello", " ", "ST world"] and t.text == "Hello ST world"
    assert not t.stopped
    assert "".join(shown) == t.text
    # after the stop, nothing more is taken
    t = TextStream(PIECES, ["!"])
    t.push(2)
    assert t.stopped and t.push(0) == "" and t.text == ""


def test_pieces_shown_per_token_add_up_to_the_text_cut_at_the_first_stop_of_any_order():
    rng = random.Random(5)
    stops = ["d!", "\n\n", "o w"]
    for _ in range(300):
        toks = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 12))]
        t, shown = stream(toks, stops)
        full = b"".join(PIECES[x] for x in toks).decode("utf-8", "replace")
        cut = min((full.find(s) for s in stops if s in full), default=-1)
        want = full if cut < 0 else full[:cut]
        assert t.text == want and "".join(shown) == want, toks
