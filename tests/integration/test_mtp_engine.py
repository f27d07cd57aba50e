"""MTP (NextN) drafts on the last stage of a DeepSeek V4 route, and Engine.truncate.

What is checked, on the tiny DeepSeek V4 fixture with one NextN block:
- ``mtp=True`` is refused (typed) where it cannot run, and changes no trunk output;
- ``mtp_draft`` of a split last stage equals the whole model's, token for token, after the
  prompt, after decode steps, and after a verifying step rolled back by ``truncate``;
- drafts are deterministic and leave the slot as it was;
- ``truncate`` inside DeepSeek V4's rollback window gives the logits (and drafts) of a run
  that never computed the dropped positions, bit for bit; outside it, RollbackUnsupported.
"""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control import prefix
from dgr.testing.fixtures import TinyDeepseek4, write_tiny_deepseek4, write_tiny_llama

needs_ranges = pytest.mark.skipif(not HAS_LAYER_RANGES,
                                  reason="the built llama.cpp carries no layer-range patches")

CFG = TinyDeepseek4(mtp=True)  # 6 layers (hash-routed 0..2, ratios 0 0 4 128 0 4) + blk.6 NextN
N = CFG.n_layer
W = CFG.hc * CFG.n_embd
# identical on every engine (they decide numerics); 1 thread: DeepSeek V4 decode depends on it
SETTINGS = dict(n_ctx=512, n_threads=1, n_ubatch=64, flash_attn=True)
# two n_ubatch chunks, past a CSA block and under the 128-token HCA block
PROMPT = np.random.default_rng(7).integers(0, CFG.n_vocab, 100).astype(np.int32)
DRAFTS = np.random.default_rng(8).integers(0, CFG.n_vocab, 40).astype(np.int32)
# the cut inside the hash-routed prefix, the one at its end (a stage without token ids of its
# own, and the first whose h rows llama.cpp's reused memory plan used to overwrite), and the last
SPLITS = (1, 3, 5)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4-mtp.gguf", CFG)


@pytest.fixture(scope="module")
def trunk_model(tmp_path_factory):
    # the same seed: the trunk tensors equal mtp_model's; no NextN block
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4.gguf",
                                TinyDeepseek4())


class Route:
    """A first stage [0, k) feeding a last stage [k, N) with MTP, or the whole model (k=0)."""

    def __init__(self, model, k: int, mtp: bool = True, **kw):
        s = {**SETTINGS, **kw}
        self.first = dgr.Engine(model, layers=(0, k), **s) if k else None
        self.last = dgr.Engine(model, layers=(k, N) if k else None, mtp=mtp, **s)

    def forward(self, slot, pos, tokens, logits="last"):
        tokens = np.asarray(tokens, np.int32)
        bnd = None if self.first is None else self.first.forward(slot, pos, tokens)
        return self.last.forward(slot, pos, tokens, bnd, logits=logits)

    def truncate(self, slot, pos):
        if self.first is not None:
            self.first.truncate(slot, pos)
        self.last.truncate(slot, pos)

    def draft(self, slot, token, n):
        return self.last.mtp_draft(slot, token, n)


def _top(logits) -> int:
    return int(np.argmax(logits[-1]))


# ---- (a) where MTP is refused --------------------------------------------------------------------


@needs_ranges
def test_mtp_refused_off_the_last_stage(mtp_model):
    for r in [(0, 3), (2, 5), (0, N - 1)]:
        with pytest.raises(errors.MtpNotSupported, match="last stage") as ei:
            dgr.Engine(mtp_model, layers=r, mtp=True, **SETTINGS)
        assert ei.value.code == 11


def test_mtp_refused_without_a_nextn_block(trunk_model, tmp_path):
    with pytest.raises(errors.MtpNotSupported, match="no NextN"):
        dgr.Engine(trunk_model, mtp=True, **SETTINGS)
    llama = write_tiny_llama(tmp_path / "tiny-llama.gguf")
    with pytest.raises(errors.MtpNotSupported, match="no NextN"):
        dgr.Engine(llama, mtp=True)


def test_mtp_draft_needs_an_mtp_engine_and_a_prompt(mtp_model):
    plain = dgr.Engine(mtp_model, **SETTINGS)
    plain.forward(0, 0, PROMPT[:4])
    with pytest.raises(errors.MtpNotSupported, match="without mtp"):
        plain.mtp_draft(0, 1, 4)
    e = dgr.Engine(mtp_model, mtp=True, **SETTINGS)
    with pytest.raises(errors.InvalidPosition, match="no positions"):
        e.mtp_draft(0, 1, 4)
    e.forward(0, 0, PROMPT[:4])
    with pytest.raises(errors.InvalidToken):
        e.mtp_draft(0, CFG.n_vocab, 4)
    with pytest.raises(errors.UnknownSlot):
        e.mtp_draft(1, 1, 4)
    with pytest.raises(errors.InvalidArgument):
        e.mtp_draft(0, 1, -1)
    assert e.mtp_draft(0, 1, 0) == []


# ---- (b) the trunk is unchanged ------------------------------------------------------------------


@needs_ranges
@pytest.mark.parametrize("k", (0,) + SPLITS)
def test_trunk_logits_unchanged_by_mtp(mtp_model, k):
    on, off = Route(mtp_model, k, mtp=True), Route(mtp_model, k, mtp=False)
    a = on.forward(0, 0, PROMPT, logits="all")
    b = off.forward(0, 0, PROMPT, logits="all")
    assert a.tobytes() == b.tobytes()
    for i in range(4):  # greedy decode steps, then a 5-token step
        t = _top(a)
        a = on.forward(0, len(PROMPT) + i, [t])
        b = off.forward(0, len(PROMPT) + i, [t])
        assert a.tobytes() == b.tobytes()
    p = len(PROMPT) + 4
    a = on.forward(0, p, DRAFTS[:5], logits="all")
    b = off.forward(0, p, DRAFTS[:5], logits="all")
    assert a.tobytes() == b.tobytes()


@needs_ranges
def test_batched_trunk_unchanged_and_drafts_match_the_whole_model(mtp_model):
    slots = np.array([0] * 30 + [1] * 12, np.int32)
    pos = np.concatenate([np.arange(30), np.arange(12)]).astype(np.int32)
    toks = np.concatenate([PROMPT[:30], PROMPT[40:52]]).astype(np.int32)
    outs, drafts = {}, {}
    for name, k, mtp in [("whole", 0, True), ("split", 3, True), ("off", 3, False)]:
        r = Route(mtp_model, k, mtp=mtp, n_slots=2)
        bnd = None if r.first is None else r.first.forward_batch(slots, pos, toks)
        outs[name] = r.last.forward_batch(slots, pos, toks, bnd, logits="all").tobytes()
        if mtp:
            drafts[name] = [r.draft(0, 5, 6), r.draft(1, 9, 6)]
    assert outs["whole"] == outs["split"] == outs["off"]
    assert drafts["whole"] == drafts["split"]


@needs_ranges
def test_describe_facts(mtp_model):
    d = dgr.Engine(mtp_model, layers=(3, N), mtp=True, **SETTINGS).describe()
    ref = dgr.Engine(mtp_model, layers=(3, N), **SETTINGS).describe()
    assert d["mtp"] and not ref["mtp"]
    assert d["n_layer_nextn"] == ref["n_layer_nextn"] == 1
    assert d["rollback_window"] == 32
    # the stage past the hash-routed layers takes token ids only for its NextN block
    assert d["needs_token_ids"] and not ref["needs_token_ids"]
    # it loads the NextN block and token_embd (patch 0001), and keeps an MTP cache
    assert d["weight_bytes"] > ref["weight_bytes"] and d["kv_bytes"] > ref["kv_bytes"]
    with pytest.raises(errors.MissingTokenIds, match="MTP"):
        dgr.Engine(mtp_model, layers=(3, N), mtp=True, **SETTINGS).forward(
            0, 0, boundary=np.zeros((2, W), np.float32))


# ---- (c) a split last stage drafts what the whole model drafts -----------------------------------


@needs_ranges
@pytest.mark.parametrize("k", SPLITS)
def test_split_drafts_equal_the_whole_models(mtp_model, k):
    whole, split = Route(mtp_model, 0), Route(mtp_model, k)
    lw = whole.forward(0, 0, PROMPT)
    ls = split.forward(0, 0, PROMPT)
    assert lw.tobytes() == ls.tobytes()
    p = len(PROMPT)
    for _ in range(3):  # decode steps, drafting at each
        t = _top(lw)
        dw, ds = whole.draft(0, t, 8), split.draft(0, t, 8)
        assert len(dw) == 8 and dw == ds
        lw, ls = whole.forward(0, p, [t]), split.forward(0, p, [t])
        p += 1
    # a verifying step [t, drafts...], 3 accepted, the rest rolled back
    t = _top(lw)
    step = [t] + whole.draft(0, t, 6)
    lw = whole.forward(0, p, step, logits="all")
    ls = split.forward(0, p, step, logits="all")
    assert lw.tobytes() == ls.tobytes()
    whole.truncate(0, p + 4)
    split.truncate(0, p + 4)
    t = int(np.argmax(lw[3]))
    assert whole.draft(0, t, 8) == split.draft(0, t, 8)
    lw, ls = whole.forward(0, p + 4, [t]), split.forward(0, p + 4, [t])
    assert lw.tobytes() == ls.tobytes()
    assert whole.draft(0, _top(lw), 8) == split.draft(0, _top(lw), 8)


# ---- (d) drafts are deterministic and leave the slot as it was -----------------------------------


def test_drafts_are_deterministic_and_stateless(mtp_model):
    a, b = dgr.Engine(mtp_model, mtp=True, **SETTINGS), dgr.Engine(mtp_model, mtp=True, **SETTINGS)
    la, lb = a.forward(0, 0, PROMPT), b.forward(0, 0, PROMPT)
    t = _top(la)
    first = a.mtp_draft(0, t, 10)
    assert [a.mtp_draft(0, t, 10) for _ in range(3)] == [first] * 3
    assert a.mtp_draft(0, t, 4) == first[:4]  # a shorter chain is a prefix
    assert a.next_pos(0) == len(PROMPT)
    # b never drafted: the same next logits and the same later drafts
    la, lb = a.forward(0, len(PROMPT), [t]), b.forward(0, len(PROMPT), [t])
    assert la.tobytes() == lb.tobytes()
    assert a.mtp_draft(0, _top(la), 10) == b.mtp_draft(0, _top(lb), 10)
    # a released slot drafts as a fresh one
    a.release(0)
    c = dgr.Engine(mtp_model, mtp=True, **SETTINGS)
    p = PROMPT[:20]
    assert a.forward(0, 0, p).tobytes() == c.forward(0, 0, p).tobytes()
    assert a.mtp_draft(0, 3, 10) == c.mtp_draft(0, 3, 10)


def test_draft_stops_at_the_end_of_the_context(mtp_model):
    e = dgr.Engine(mtp_model, mtp=True, **{**SETTINGS, "n_ctx": 24})
    e.forward(0, 0, PROMPT[:20])
    # token at 20 and the drafts must fit as one step in 24 positions: 3 drafts
    d = e.mtp_draft(0, 1, 8)
    assert len(d) == 3 and d == e.mtp_draft(0, 1, 3)
    e.forward(0, 20, [1] + d)  # the verifying step fits
    assert e.next_pos(0) == 24
    assert e.mtp_draft(0, 4, 8) == []


# ---- (e) truncate: exact inside the rollback window, refused outside ----------------------------


@pytest.mark.parametrize("mtp", [False, True], ids=["trunk", "mtp"])
@pytest.mark.parametrize("k, keep", [(4, 0), (4, 1), (4, 3), (8, 6), (31, 4), (31, 0)],
                         ids=lambda v: str(v))
def test_truncate_parity(mtp_model, mtp, k, keep):
    """Forward prompt, then a step of k+1 tokens; truncate to keep `keep` of them (0: the whole
    step); then one token. The reference computed only the kept tokens (as one step).

    Keeping one token compares a row of a (k+1)-row step with a one-row step's: the same bits
    only where this CPU computes a one-row product as a many-row one does, which
    ``prefix.single_rows_exact`` measures (on a Sapphire Rapids VM, AVX-512, it does not: the
    logits then differ by about 1e-4). Where it does not, the two must agree to 1e-3."""
    a, b = dgr.Engine(mtp_model, mtp=mtp, **SETTINGS), dgr.Engine(mtp_model, mtp=mtp, **SETTINGS)
    exact = keep != 1 or prefix.single_rows_exact(b)

    def same(x, y) -> None:
        if exact:
            assert x.tobytes() == y.tobytes()
        else:
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-3)

    a.forward(0, 0, PROMPT)
    b.forward(0, 0, PROMPT)
    p = len(PROMPT)
    a.forward(0, p, DRAFTS[:k + 1], logits="all")
    a.truncate(0, p + keep)
    assert a.next_pos(0) == p + keep
    if keep:
        b.forward(0, p, DRAFTS[:keep], logits="all")
    la, lb = a.forward(0, p + keep, [5]), b.forward(0, p + keep, [5])
    same(la, lb)
    if mtp and exact:
        assert a.mtp_draft(0, _top(la), 8) == b.mtp_draft(0, _top(lb), 8)
    # and the decode goes on identically
    la, lb = a.forward(0, p + keep + 1, [_top(la)]), b.forward(0, p + keep + 1, [_top(lb)])
    same(la, lb)


@pytest.mark.parametrize("mtp", [False, True], ids=["trunk", "mtp"])
def test_truncate_outside_the_window_is_refused(mtp_model, mtp):
    e = dgr.Engine(mtp_model, mtp=mtp, **SETTINGS)
    p = len(PROMPT)

    def refill(*steps):
        e.release(0)
        e.forward(0, 0, PROMPT)
        q = p
        for n in steps:
            e.forward(0, q, DRAFTS[q - p:q - p + n])
            q += n
        return q

    cases = [
        ((40,), 33),   # more than the window of 32
        ((3, 2), 3),   # more than the last forward computed
        ((5,), None),  # a second truncate before a forward: the snapshot is single-use
    ]
    for steps, back in cases:
        q = refill(*steps)
        if back is None:
            e.truncate(0, q - 2)
            q, back = q - 2, 1
        with pytest.raises(errors.RollbackUnsupported, match="re-prefill") as ei:
            e.truncate(0, q - back)
        assert ei.value.code == 15
        assert e.next_pos(0) == 0  # cleared
        # the slot serves a fresh prefill, and is then what a fresh engine computes
        ref = dgr.Engine(mtp_model, mtp=mtp, **SETTINGS)
        assert e.forward(0, 0, PROMPT[:9]).tobytes() == ref.forward(0, 0, PROMPT[:9]).tobytes()
        if mtp:
            assert e.mtp_draft(0, 2, 5) == ref.mtp_draft(0, 2, 5)
    # the edges that work: the whole window, a no-op past the end, back to 0
    q = refill(40)
    e.truncate(0, q - 32)
    e.truncate(0, q + 5)
    assert e.next_pos(0) == q - 32
    e.truncate(0, 0)
    assert e.next_pos(0) == 0
    with pytest.raises(errors.InvalidPosition):
        e.truncate(0, -1)
    with pytest.raises(errors.UnknownSlot):
        e.truncate(3, 0)


@needs_ranges
def test_a_slice_of_the_last_stage_drafts(mtp_model, tmp_path):
    """A dgr slice of the last stage carries the NextN block and token_embd: it drafts too."""
    from dgr.artifacts.slice import slice_model

    first = slice_model(mtp_model, (0, 3), tmp_path / "s0-3.gguf")["path"]
    last = slice_model(mtp_model, (3, N), tmp_path / "s3-6.gguf")["path"]
    f = dgr.Engine(first, layers=(0, 3), **SETTINGS)
    tail = dgr.Engine(last, layers=(3, N), mtp=True, **SETTINGS)
    whole = dgr.Engine(mtp_model, mtp=True, **SETTINGS)
    lt = tail.forward(0, 0, PROMPT, f.forward(0, 0, PROMPT))
    assert lt.tobytes() == whole.forward(0, 0, PROMPT).tobytes()
    assert tail.mtp_draft(0, _top(lt), 8) == whole.mtp_draft(0, _top(lt), 8)
