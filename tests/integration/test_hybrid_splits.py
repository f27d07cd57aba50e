"""Recurrent and hybrid models split by layer range (patches 0014-0016): each stage keeps the
conv/SSM (or delta-net, short-conv) state and the attention KV of its own layers only, and a
route of three stages computes the whole model's bits.

The fixtures are upstream's generator's (``dgr.testing.archs``) at 8 layers, so each of three
stages holds several: Qwen3.5 and Qwen3-Next (gated delta net + attention, every second layer
attention here), Mamba-2 (SSM only), Granite-Hybrid and Jamba (Mamba + attention), LFM2 (short
convolutions + attention), Falcon-H1 (attention and Mamba-2 in every layer) and RWKV-6, RWKV-7
and ARWKV-7 (token shift and wkv state; RWKV-7's seams carry ``v_first``, patch 0025). The prompts
run 75 tokens in ubatches of 8 (10 pieces), then greedy decode; batched sessions of different
lengths go through one forward per step, whole and split alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control.parity import compare
from dgr.core.engine import Engine
from dgr.testing import archs

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

ARCHS = ("qwen35", "qwen3next", "mamba2", "granitehybrid", "lfm2", "jamba", "falcon-h1", "rwkv6",
         "rwkv7", "arwkv7")
N_LAYER = 8
LAYOUTS = ([(0, 3), (3, 6), (6, 8)], [(0, 1), (1, 7), (7, 8)], [(0, 5), (5, 6), (6, 8)])
SETTINGS = dict(n_ctx=128, n_threads=1, n_ubatch=8, flash_attn=True)
PROMPT = 75
SESSIONS = 8


@pytest.fixture(scope="module")
def models():
    written = archs.write("^(" + "|".join(ARCHS) + ")$", n_layer=N_LAYER)
    got = {archs.arch_of(f): f for f in written.files}
    assert sorted(got) == sorted(ARCHS), (sorted(got), written.failed)
    return got


def _prompt(n: int, n_vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda r: "-".join(f"{a}:{b}" for a, b in r))
@pytest.mark.parametrize("arch", ARCHS)
def test_three_stages_compute_the_whole_models_bits(models, arch, layout):
    whole = Engine(models[arch], **SETTINGS)
    assert whole.n_layer == N_LAYER
    prompt = _prompt(PROMPT, whole.n_vocab, 1)
    rep = compare(models[arch], layout, prompt, decode_steps=6, whole=whole, **SETTINGS)
    assert rep.prompt_rows_identical, f"{arch} {layout}: prompt rows differ"
    assert rep.bit_identical, [(s.step, s.max_abs_diff) for s in rep.steps]


def _stages(path, layout, n_slots):
    return [Engine(path, layers=r, n_slots=n_slots, **SETTINGS) for r in layout]


def _run(stages, slots, pos, tokens):
    """One forward of a batch through a chain of engines (one engine: the whole model)."""
    x = None
    for e in stages:
        x = e.forward_batch(slots, pos, tokens, boundary=x).copy()
    return x


def _greedy_batched(stages, prompts, steps):
    """The sessions' prompts in one batch, then one batch a step: each session's logits rows."""
    for e in stages:
        for j in range(len(prompts)):
            e.release(j)
    slots = np.concatenate([np.full(len(p), j, np.int32) for j, p in enumerate(prompts)])
    pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
    logits = _run(stages, slots, pos, np.concatenate(prompts))
    out = [logits]
    slots = np.arange(len(prompts), dtype=np.int32)
    for i in range(steps):
        pos = np.array([len(p) + i for p in prompts], np.int32)
        logits = _run(stages, slots, pos, logits.argmax(1).astype(np.int32))
        out.append(logits)
    return np.stack(out, axis=1)  # [session, step, n_vocab]


@pytest.mark.parametrize("arch", ("qwen35", "mamba2", "granitehybrid", "rwkv7"))
def test_eight_batched_sessions_of_different_lengths_split_as_the_whole_model(models, arch):
    """Each session has its own state cells on every stage: the route's rows of 8 sessions
    (prompts of 9 to 75 tokens, then decode) are the whole model's, bit for bit, in the same
    batches; and each session's greedy tokens are those of the whole model run alone."""
    layout = LAYOUTS[0]
    whole = Engine(models[arch], n_slots=SESSIONS, **SETTINGS)
    prompts = [_prompt(PROMPT - 9 * j, whole.n_vocab, 10 + j) for j in range(SESSIONS)]
    assert len({len(p) for p in prompts}) == SESSIONS and min(map(len, prompts)) > 8
    split = _greedy_batched(_stages(models[arch], layout, SESSIONS), prompts, 5)
    ref = _greedy_batched([whole], prompts, 5)
    assert split.tobytes() == ref.tobytes(), float(np.abs(split - ref).max())
    for j, p in enumerate(prompts):  # alone: the same greedy tokens
        alone = _greedy_batched([whole], [p], 5)[0]
        assert (alone.argmax(1) == split[j].argmax(1)).all(), j


def test_a_stage_keeps_the_state_of_its_own_layers_only(models):
    """A stage allocates conv/SSM state and KV for its own layers: the three stages' state
    and KV bytes add up to the whole model's."""
    whole = Engine(models["qwen35"], **SETTINGS)
    stages = _stages(models["qwen35"], LAYOUTS[0], 1)
    parts = [s.describe()["kv_bytes"] for s in stages]
    assert all(0 < p < whole.describe()["kv_bytes"] for p in parts), parts
    assert sum(parts) == whole.describe()["kv_bytes"], (parts, whole.describe()["kv_bytes"])


def test_a_recurrent_stage_refuses_to_drop_a_tail_it_keeps_no_snapshot_of(models):
    """A recurrent state keeps no history: a truncate to a position without a state snapshot is
    refused (RollbackUnsupported, naming the snapshots, the slot cleared), a whole one is not;
    with ``state_snapshots=0`` none is kept at all; the describe record says it rolls back
    nothing (window 0) but to its snapshots."""
    stage = Engine(models["qwen35"], layers=(0, 3), **SETTINGS)
    d = stage.describe()
    assert d["rollback_window"] == 0 and d["state_snapshots"] == 4
    prompt = _prompt(20, stage.n_vocab, 3)
    stage.forward(0, 0, prompt)  # decodes of 8, 8 and 4 tokens: snapshots at 8 and 16
    assert stage.state_snapshots(0) == [8, 16]
    with pytest.raises(errors.RollbackUnsupported,
                       match=r"keeps no history.*snapshots only at the ends of whole chunks of 8.*"
                             r"at 8, 16.*re-prefill"):
        stage.truncate(0, 15)
    assert stage.next_pos(0) == 0 and stage.state_snapshots(0) == []
    stage.forward(0, 0, prompt)
    stage.truncate(0, 0)
    assert stage.next_pos(0) == 0
    none = Engine(models["qwen35"], layers=(0, 3), state_snapshots=0, **SETTINGS)
    assert none.describe()["state_snapshots"] == 0
    none.forward(0, 0, prompt)
    assert none.state_snapshots(0) == []
    with pytest.raises(errors.RollbackUnsupported, match="keeps no state snapshots"):
        none.truncate(0, 16)
    with pytest.raises(errors.InvalidArgument, match="state_snapshots"):
        Engine(models["qwen35"], layers=(0, 3), state_snapshots=-1, **SETTINGS)


def _chunks(stages, slot, tokens, first):
    """``tokens`` from position ``first`` in steps of ``n_ubatch`` (as the driver prefills),
    through a chain of engines: the last step's output rows."""
    ub = SETTINGS["n_ubatch"]
    for a in range(0, len(tokens), ub):
        x = None
        piece = tokens[a:a + ub]
        for e in stages:
            x = e.forward(slot, first + a, piece, boundary=x).copy()
    return x


def test_an_iswa_hybrids_snapshot_leaves_its_sliding_window_cells_in_place(models):
    """The LFM2 fixture has sliding-window attention layers beside its conv layers (an iswa
    hybrid). Its snapshots hold the conv rows alone: llama.cpp's own state would hold the
    sequence's sliding-window cells too, which restored land in other cells than a fresh
    prefill's, and the CPU flash attention's tiled rows (every chunk of 64 rows, and since patch
    0026 every chunk) depend on where a sequence's cells are. In chunks of 64, a truncate back
    to 128 of a 256-token turn, then a next turn's 128 new tokens: a fresh prefill's bits."""
    ub = 64
    settings = {**SETTINGS, "n_ctx": 512, "n_ubatch": ub}
    e = Engine(models["lfm2"], **settings)
    assert e.describe()["state_bytes"] > 0
    turn1 = _prompt(256, e.n_vocab, 21)
    turn2 = np.concatenate([turn1[:128], _prompt(128, e.n_vocab, 22)])

    def rows(tokens, first):
        return [np.array(e.forward(0, first + a, tokens[a:a + ub], logits="all"), copy=True)
                for a in range(0, len(tokens), ub)]

    e.release(0)
    fresh = rows(turn2, 0)
    e.release(0)
    rows(turn1, 0)
    e.truncate(0, 128)
    assert e.next_pos(0) == 128
    got = rows(turn2[128:], 128)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, fresh[2:]))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_truncate_to_a_snapshot_continues_with_a_fresh_prefills_bits(models, arch):
    """Each stage keeps its state at the ends of whole chunks prefilled from position 0 (the
    last four); a truncate back to one restores it and drops the attention cells past it, so a
    next turn that shares the first 64 positions and prefills the rest gives, on every stage
    of a three-way split and on the whole model, the bits of a fresh prefill of the new prompt,
    and decodes as it does."""
    layout = LAYOUTS[0]
    n_vocab = Engine(models[arch], layers=(0, 1), **SETTINGS).n_vocab
    turn1 = _prompt(PROMPT, n_vocab, 21)
    turn2 = np.concatenate([turn1[:64], _prompt(23, n_vocab, 22)])

    def go(stages, reuse):
        for e in stages:
            e.release(0)
        if reuse:
            x = _chunks(stages, 0, turn1, 0)
            for i in range(3):  # a reply, decoded step by step (no snapshot past 72)
                tok = np.array([int(x[-1].argmax())], np.int32)
                for e in stages:
                    x = e.forward(0, PROMPT + i, tok, boundary=None if e.is_first else x).copy()
            assert [e.state_snapshots(0) for e in stages] == [[48, 56, 64, 72]] * len(stages)
            for e in stages:
                e.truncate(0, 64)
                assert e.next_pos(0) == 64 and e.state_snapshots(0) == [48, 56, 64]
            x = _chunks(stages, 0, turn2[64:], 64)
        else:
            x = _chunks(stages, 0, turn2, 0)
        out = [x[-1:].copy()]
        for i in range(4):
            tok = np.array([int(out[-1][-1].argmax())], np.int32)
            for e in stages:
                x = e.forward(0, len(turn2) + i, tok, boundary=None if e.is_first else x).copy()
            out.append(x[-1:].copy())
        return np.concatenate(out)

    whole = Engine(models[arch], **SETTINGS)
    ref = go([whole], reuse=False)
    assert go([whole], reuse=True).tobytes() == ref.tobytes()
    got = go(_stages(models[arch], layout, 1), reuse=True)
    assert got.tobytes() == ref.tobytes(), float(np.abs(got - ref).max())


def test_the_state_bytes_of_the_stages_add_up_to_the_whole_models(models, tiny_llama):
    """The capacity input beside KV bytes: each stage's recurrent state bytes per session (its
    own layers' rows), adding up over a split to the whole model's, and none on an attention
    model; the snapshots' host bytes are counted."""
    for arch in ("qwen35", "mamba2", "falcon-h1"):
        whole = Engine(models[arch], **SETTINGS).describe()["state_bytes"]
        parts = [s.describe()["state_bytes"] for s in _stages(models[arch], LAYOUTS[0], 1)]
        assert whole > 0 and sum(parts) == whole, (arch, parts, whole)
    attn = Engine(tiny_llama, **SETTINGS).describe()
    assert attn["state_bytes"] == 0 and attn["state_snapshots"] == 0
    stage = Engine(models["mamba2"], layers=(0, 3), n_slots=2, **SETTINGS)
    per = stage.describe()["state_bytes"]
    assert stage.describe()["state_snapshot_bytes"] == 0
    stage.forward(1, 0, _prompt(16, stage.n_vocab, 4))
    assert stage.state_snapshots(1) == [8, 16]
    held = stage.describe()["state_snapshot_bytes"]
    assert 2 * per <= held < 2 * per + 4096, (per, held)  # two snapshots and their headers
    stage.release(1)
    assert stage.describe()["state_snapshot_bytes"] == 0


@pytest.mark.parametrize("arch", ("qwen35", "mamba2"))
def test_a_forked_session_continues_as_the_original_would(models, arch):
    """``n`` > 1 forks a session's caches (``copy_slot``): on a recurrent stage the fork shares
    the state cell until either side decodes, then each goes on with its own. Every stage of the
    route forks alike, and both continuations are the whole model's."""
    layout = LAYOUTS[0]
    prompt = _prompt(40, 128, 5)
    a, b = np.array([7], np.int32), np.array([11], np.int32)

    def run(stages, fork):
        for e in stages:
            e.release(0)
            e.release(1)
        _run(stages, np.zeros(len(prompt), np.int32), np.arange(len(prompt), dtype=np.int32),
             prompt)
        if fork:
            for e in stages:
                e.copy_slot(0, 1)
        else:  # the reference: the prompt again in slot 1
            _run(stages, np.ones(len(prompt), np.int32), np.arange(len(prompt), dtype=np.int32),
                 prompt)
        n = len(prompt)
        out = [_run(stages, np.array([0, 1], np.int32), np.array([n, n], np.int32),
                    np.concatenate([a, b]))]
        for i in range(1, 4):
            toks = out[-1].argmax(1).astype(np.int32)
            out.append(_run(stages, np.array([0, 1], np.int32),
                            np.array([n + i, n + i], np.int32), toks))
        return np.stack(out)

    whole = Engine(models[arch], n_slots=2, **SETTINGS)
    ref = run([whole], fork=False)
    assert run([whole], fork=True).tobytes() == ref.tobytes()
    assert run(_stages(models[arch], layout, 2), fork=True).tobytes() == ref.tobytes()
