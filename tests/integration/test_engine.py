"""dgr.Engine on the tiny random llama: API, slots, determinism, and every typed error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.vendor import cpu_features


@pytest.fixture(scope="module")
def eng(tiny_llama):
    return dgr.Engine(tiny_llama, n_ctx=64, n_slots=3, n_ubatch=8, n_threads=1)


def test_describe(eng, tiny_llama):
    d = eng.describe()
    assert d["arch"] == "llama"
    assert d["n_layer"] == 4 and d["n_embd"] == 64 and d["vocab_size"] == 128
    assert d["n_ctx"] == 64 and d["n_slots"] == 3 and d["n_ubatch"] == 8 and d["n_threads"] == 1
    assert d["flash_attn"] is True and d["type_k"] == "f16"
    assert d["layers"] == [0, 4] and d["is_first"] and d["is_last"]
    assert d["identity"].startswith("sha256:") and len(d["identity"]) == 7 + 64
    assert d["weight_bytes"] > 0 and d["kv_bytes"] > 0
    assert d["model"] == str(tiny_llama)


def _test_vocab_ids(text: str, n_vocab: int = 128) -> list[int]:
    """The 'test' tokenizer of the patched llama.cpp, computed here: each 5-byte chunk of the
    UTF-8 text is one token, ``(31-polynomial hash of its bytes) % n_vocab``."""
    data = text.encode("utf-8")
    out = []
    for i in range(0, len(data), 5):
        h = 0
        for b in data[i:i + 5]:
            h = h * 31 + b
        out.append(h % n_vocab)
    return out


def test_tokenize_detokenize(eng):
    # the tiny model's 'test' vocabulary hashes text one way and prints ids as hex the other
    # way (no round trip exists): both directions against the rule computed independently
    for text in ("tok_1 tok_2", "naïve café 🙂", "x"):
        toks = eng.tokenize(text)
        assert toks.dtype == np.int32
        assert toks.tolist() == _test_vocab_ids(text) and len(toks) > 0
    assert eng.detokenize([0, 10, 127, 2]) == "0a7f2"
    assert eng.detokenize(eng.tokenize("tok_1 tok_2")) == "".join(
        f"{t:x}" for t in _test_vocab_ids("tok_1 tok_2"))
    assert eng.detokenize([]) == ""


@pytest.fixture(scope="module")
def smol_vocab(smollm2):
    return dgr.Engine(smollm2, n_ctx=64, n_slots=1, n_threads=1)


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café — 日本語 🙂",
                                  "  two  spaces\n\tand a tab "])
def test_tokenize_detokenize_round_trip(smol_vocab, text):
    """A real vocabulary (SmolLM2's byte-level BPE): text -> tokens -> the same text, and
    the tokens of that text are the same tokens again."""
    toks = smol_vocab.tokenize(text, add_special=False)
    assert toks.dtype == np.int32 and len(toks) > 0
    back = smol_vocab.detokenize(toks)
    assert back == text
    assert smol_vocab.tokenize(back, add_special=False).tolist() == toks.tolist()


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café — 日本語 🙂"])
def test_token_pieces_are_the_bytes_llama_cpp_renders_per_token(smol_vocab, text):
    """Every id's bytes (what llama-server appends per token): the pieces of a text's
    tokens join to the text, byte by byte, even where one character spans two tokens; ids
    past the vocabulary are left out, control tokens are empty unless asked for."""
    pieces = smol_vocab.token_pieces()
    assert len(pieces) == smol_vocab.n_vocab and all(isinstance(p, bytes) for p in pieces)
    toks = smol_vocab.tokenize(text, add_special=False).tolist()
    assert b"".join(pieces[t] for t in toks).decode() == text == smol_vocab.detokenize(toks)
    assert any(len(pieces[t].decode("utf-8", "replace")) != len(pieces[t].decode("utf-8",
               "ignore")) for t in toks) or text.isascii()  # a character split over tokens
    n = smol_vocab.n_vocab
    assert smol_vocab.token_pieces(n - 2, 10) == pieces[n - 2:]
    assert smol_vocab.token_pieces(0, 1) == [b""]  # <|endoftext|>: a control token
    assert smol_vocab.token_pieces(0, 1, special=True) == [b"<|endoftext|>"]
    with pytest.raises(dgr.errors.InvalidArgument):
        smol_vocab.token_pieces(-1, 3)


def test_tokenizing_never_waits_for_the_engines_lock(eng):
    """Tokenize, detokenize and token_pieces read the vocabulary only: they run while a
    forward holds the engine's lock (as llama-server tokenizes beside its decode loop)."""
    import concurrent.futures

    with eng.lock, concurrent.futures.ThreadPoolExecutor(1) as ex:
        f = ex.submit(lambda: (eng.tokenize("tok_1"), eng.detokenize([5]),
                               eng.token_pieces(0, 4)))
        toks, text, pieces = f.result(timeout=30)
    assert toks.tolist() == _test_vocab_ids("tok_1") and text == "5"
    assert [p.decode() for p in pieces] == ["0", "1", "2", "3"]


def test_forward_logits_shapes(eng):
    eng.release(0)
    toks = np.arange(20, dtype=np.int32) % 128  # > n_ubatch: computed in chunks
    last = eng.forward(0, 0, toks)
    assert last.shape == (1, 128) and last.dtype == np.float32 and np.isfinite(last).all()
    assert eng.next_pos(0) == 20
    allrows = eng.forward(1, 0, toks, logits="all")
    assert allrows.shape == (20, 128)
    # asking for every row changes the last layer's matmul shapes (no output-row pruning), so
    # the last row is close to, not bit-equal with, the last-row-only result
    np.testing.assert_allclose(allrows[-1], last[0], rtol=1e-4, atol=1e-4)
    mask = np.zeros(3, dtype=bool)
    mask[[0, 2]] = True
    two = eng.forward(1, 20, [5, 6, 7], logits=mask)
    assert two.shape == (2, 128)
    eng.release(0)
    eng.release(1)
    assert eng.next_pos(0) == 0


def test_forward_into_a_reused_buffer(eng):
    eng.release(0)
    eng.release(1)
    # the same steps on another slot into fresh arrays: the logits the buffer must hold
    want = [eng.forward(1, 0, [1, 2, 3]), eng.forward(1, 3, [4])]
    assert not np.array_equal(want[0], want[1])
    buf = np.full((1, 128), np.nan, dtype=np.float32)
    for pos, toks, w in ((0, [1, 2, 3], want[0]), (3, [4], want[1])):
        out = eng.forward(0, pos, toks, out=buf)
        assert out is buf  # written in place, and overwritten by the next step
        assert buf.tobytes() == w.tobytes()
    eng.release(0)
    eng.release(1)


def _greedy(eng, slot, prompt, steps):
    eng.release(slot)
    logits = eng.forward(slot, 0, prompt)
    seq, rows = [], [logits[0].copy()]
    pos = len(prompt)
    for _ in range(steps):
        t = int(np.argmax(logits[0]))
        seq.append(t)
        logits = eng.forward(slot, pos, [t])
        rows.append(logits[0].copy())
        pos += 1
    return seq, np.stack(rows)


def test_deterministic_and_slots_are_independent(eng):
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    seq_a, rows_a = _greedy(eng, 0, prompt, 6)
    seq_b, rows_b = _greedy(eng, 2, prompt, 6)
    assert seq_a == seq_b
    assert rows_a.tobytes() == rows_b.tobytes()
    # interleave two sessions step by step on slots 0 and 1: each equals its solo run
    other = [7, 7, 1, 2]
    eng.release(0)
    eng.release(1)
    la = eng.forward(0, 0, prompt)
    eng.forward(1, 0, other)
    got = [la[0].copy()]
    pos = len(prompt)
    for t in seq_a:
        got.append(eng.forward(0, pos, [t])[0].copy())
        eng.forward(1, len(other) + pos - len(prompt), [int(t) % 128])
        pos += 1
    assert np.stack(got).tobytes() == rows_a.tobytes()


# ---- typed errors (issue: each raises a specific DgrError subclass, never aborts) ----------


def test_missing_file(tmp_path):
    with pytest.raises(errors.ModelNotFound, match="not found"):
        dgr.Engine(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 not a model at all" * 10)
    with pytest.raises(errors.InvalidModel, match="not a GGUF"):
        dgr.Engine(p)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.97])
def test_truncated(tiny_llama, tmp_path, keep):
    data = tiny_llama.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(errors.InvalidModel, match="truncated|corrupt"):
        dgr.Engine(p)


def test_token_outside_vocab(eng):
    eng.release(0)
    with pytest.raises(errors.InvalidToken, match="outside the vocabulary"):
        eng.forward(0, 0, [1, 128])
    with pytest.raises(errors.InvalidToken):
        eng.forward(0, 0, [-1])
    with pytest.raises(errors.InvalidToken):
        eng.detokenize([5000])
    assert eng.next_pos(0) == 0  # nothing was computed


def test_positions_not_contiguous(eng):
    eng.release(0)
    with pytest.raises(errors.InvalidPosition, match="contiguous"):
        eng.forward(0, [0, 1, 3], [1, 2, 3])
    with pytest.raises(errors.InvalidPosition, match="gap"):
        eng.forward(0, 5, [1, 2])
    eng.forward(0, 0, [1, 2])
    with pytest.raises(errors.InvalidPosition, match="already computed"):
        eng.forward(0, 1, [9])
    with pytest.raises(errors.InvalidPosition):
        eng.forward(0, [2, 3], [1])
    eng.release(0)


def test_full_context(eng):
    eng.release(0)
    eng.forward(0, 0, list(range(60)))
    with pytest.raises(errors.ContextFull, match="exceed its context"):
        eng.forward(0, 60, [1, 2, 3, 4, 5])
    eng.forward(0, 60, [1, 2, 3, 4])  # exactly full still works
    eng.release(0)


def test_unknown_slot(eng):
    with pytest.raises(errors.UnknownSlot, match="slot 3 does not exist"):
        eng.forward(3, 0, [1])
    with pytest.raises(errors.UnknownSlot):
        eng.release(-1)
    with pytest.raises(errors.UnknownSlot):
        eng.next_pos(99)


def test_bad_arguments(eng, tiny_llama):
    with pytest.raises(errors.InvalidArgument):
        eng.forward(0, 0, [])
    with pytest.raises(errors.InvalidArgument):
        eng.forward(0, 0, [1, 2], logits="some")
    with pytest.raises(errors.InvalidBoundary, match="first stage"):
        eng.forward(0, 0, [1], boundary=np.zeros((1, 64), np.float32))
    with pytest.raises(errors.InvalidArgument, match="n_slots"):
        dgr.Engine(tiny_llama, n_slots=0)
    with pytest.raises(errors.InvalidArgument, match="type_k"):
        dgr.Engine(tiny_llama, type_k="f7")
    # more slots than n_ubatch: llama.cpp would abort the process at the first decode
    with pytest.raises(errors.InvalidArgument, match=r"n_slots \(9\) must not exceed n_ubatch"):
        dgr.Engine(tiny_llama, n_slots=9, n_ubatch=8)
    with pytest.raises(errors.MtpNotSupported, match="no NextN"):
        dgr.Engine(tiny_llama, mtp=True)


def test_engine_survives_errors(eng):
    """After every error above the engine still computes."""
    eng.release(0)
    assert eng.forward(0, 0, [1, 2, 3]).shape == (1, 128)
    eng.release(0)


def test_unbuilt_core_import_error_says_how_to_build():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "dgr._core._core":
                    raise ImportError("simulated: no compiled module")
        sys.meta_path.insert(0, Block())
        try:
            import dgr._core
        except ImportError as e:
            from dgr.errors import CoreNotBuilt
            assert isinstance(e, CoreNotBuilt), type(e)
            print("MSG", e)
        else:
            raise SystemExit("import succeeded")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    assert "pip install -e ." in proc.stdout


def test_build_info_names_the_pinned_stack():
    """The compiled core reports the llama.cpp commit and patch stack it was built against."""
    from dgr._core import BUILD_INFO
    from dgr.vendor import Vendor

    v = Vendor()
    assert BUILD_INFO["llama_cpp_commit"] == v.commit
    assert BUILD_INFO["patch_stack_hash"] == v.patch_stack_hash(), "rebuild: pip install -e ."
    assert BUILD_INFO["vendor_key"] == v.key()


def test_a_prompt_computes_on_this_cpus_quantized_matrix_kernels(tiny_q8):
    """A prompt of 40 rows through q8_0 matrices, in a process of its own (a fault must fail
    this test, not the run). On a CPU with AMX (Sapphire Rapids and later) a native build
    repacks them for ggml's AMX kernels, whose tile path (more than one row) faulted in
    its first product before patch 0013: GCC dropped the stores of the tile config that
    ``ldtilecfg`` then loaded. Elsewhere the same prompt checks the kernels the CPU has."""
    code = textwrap.dedent(f"""
        import numpy as np, dgr
        eng = dgr.Engine({str(tiny_q8)!r}, n_ctx=64, n_ubatch=64, n_threads=2)
        tokens = np.arange(1, 41, dtype=np.int32)
        out = eng.forward(0, 0, tokens=tokens, logits="all")
        print(out.shape, bool(np.isfinite(out).all()))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} (amx: {'amx_int8' in cpu_features()[2]}): "
        f"{proc.stderr[-2000:]}")
    assert proc.stdout.split() == ["(40,", "128)", "True"]
