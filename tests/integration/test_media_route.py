"""An image prompt through a route of workers (dgr.worker over gRPC and its data plane): the
driver sends the encoded image as a media step (``AsyncRouteSession.prefill_media``: the
first stage takes the rows instead of token embeddings, every stage the positions, all four
M-RoPE sections of them, and the causality: ``wire.Forward.media`` / ``sections`` /
``causal``), and the last row's logits are the whole model's, bit for bit, at every 2-stage
cut and a 3-stage layout, on the gRPC and the direct-relay paths, and again after a recovery
that replays the media step's rows under a new epoch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.core.media import Media
from dgr.driver.media import MediaKey, MediaRef, MediaStep, prompt_keys
from dgr.driver.route import AsyncRoute
from dgr.testing.mmproj import write_tiny_vlm
from dgr.testing.stages import threaded_stages
from dgr.vendor import Vendor

SETTINGS = dict(n_ctx=512, n_slots=2, n_threads=1, n_ubatch=64)
LAYOUTS = [[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 3), (3, 4)], [(0, 1), (1, 3), (3, 4)]]


@pytest.fixture(scope="module", params=["qwen25vl", "gemma3"])
def vlm(request, tmp_path_factory):
    text, mmproj = write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)
    image = (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()
    engine = dgr.Engine(str(text), **SETTINGS)
    media = Media(engine, str(mmproj))
    prompt = f"hello there {media.marker} what is in it?"
    chunks = media.tokenize(prompt, [image])
    plan, p = [], 0
    for i, c in enumerate(chunks):
        if c["kind"] == "text":
            plan.append(c["tokens"])
        else:
            plan.append(MediaStep(media.encode(i), media.positions(i, p), c["kind"],
                                  causal=not c["non_causal"], id=c["id"]))
        p += c["n_pos"]
    # the whole model's last-row logits, engine by engine (tests/integration/test_media.py
    # shows them llama.cpp's own mtmd_helper_eval_chunks path's)
    out, p = None, 0
    for step in plan:
        if isinstance(step, MediaStep):
            out = engine.forward_media(0, step.positions, step.rows, causal=step.causal)
            p += step.span
        else:
            out = engine.forward(0, p, tokens=np.asarray(step, np.int32))
            p += len(step)
    return request.param, str(text), plan, np.array(out[-1])


async def _through(r, plan, *, recover_after_media=False):
    s = r.session()
    for k, step in enumerate(plan):
        last = k == len(plan) - 1
        if isinstance(step, MediaStep):
            await s.prefill_media(step)
            if recover_after_media:  # a new epoch: every step replayed, the media's rows too
                await r.recovery.recover(s, errors.SessionError("test: replay"), 1)
        else:
            await s.prefill(step, sample=last, logits=last)
    img = next(p for p in plan if isinstance(p, MediaStep))
    # the media's id at each position it advances, where a token id would be
    assert s.media and s.history[len(plan[0])] == MediaKey(img.id, 0)
    return s, s.logits[-1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "-".join(f"{a}.{b}" for a, b in l))
def test_an_image_prompt_through_a_route_is_the_whole_models(vlm, layout):
    _, text, plan, want = vlm

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            s, got = await _through(r, plan)
            assert got.tobytes() == want.tobytes()
            img = next(p for p in plan if isinstance(p, MediaStep))
            # the session advanced by the image's positions (M-RoPE: fewer than its rows)
            assert len(s.history) == sum(len(p) if isinstance(p, list) else p.span
                                         for p in plan)
            assert s.steps[1] == (img.first_pos, img.span)
            # a later prompt keeps nothing past the first media position (no token ids)
            assert s.reusable(list(s.history[:img.first_pos]) + [5, 6]) <= img.first_pos
            await s.close(keep=True)

    with threaded_stages(text, layout, SETTINGS) as ws:
        asyncio.run(go(ws))


def test_relay_and_recovery_carry_the_media_step(vlm):
    _, text, plan, want = vlm

    async def go(ws):
        async with AsyncRoute([w.address for w in ws], relay=True) as r:
            _, got = await _through(r, plan)
            assert got.tobytes() == want.tobytes()
            s, again = await _through(r, plan, recover_after_media=True)
            assert s.recoveries == 1 and again.tobytes() == want.tobytes()

    with threaded_stages(text, [(0, 1), (1, 3), (3, 4)], SETTINGS) as ws:
        asyncio.run(go(ws))


def test_a_media_step_is_checked_before_it_is_sent(vlm):
    _, text, plan, _ = vlm
    img = next(p for p in plan if isinstance(p, MediaStep))
    with pytest.raises(errors.InvalidArgument, match="image or audio"):
        MediaStep(img.rows, img.positions, "video")
    with pytest.raises(errors.InvalidPosition, match="positions"):
        MediaStep(img.rows, img.positions.reshape(-1)[:3])

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            s = r.session()
            with pytest.raises(errors.InvalidPosition, match="continues at 0"):
                await s.prefill_media(img)  # it starts after the text chunk before it
            await s.prefill(plan[0], sample=False)
            bad = MediaStep(img.rows[:, :-1], img.positions, img.kind, causal=img.causal)
            with pytest.raises(errors.InvalidBoundary):
                await s.prefill_media(bad)  # the first stage's rows are n_embd_inp wide

    with threaded_stages(text, [(0, 2), (2, 4)], SETTINGS) as ws:
        asyncio.run(go(ws))


def _workers(text, mmproj, layout):
    from dgr.worker.process import ThreadedWorker

    return [ThreadedWorker(dgr.Engine(text, layers=r, **SETTINGS),
                           mmproj=mmproj if r[0] == 0 else "") for r in layout]


def test_the_first_stage_encodes_and_a_split_generates_the_whole_models_tokens(tmp_path):
    """``--mmproj`` on the first stage: ``AsyncRoute.encode_media`` has it cut and encode the
    prompt on its own engine's device (EncodeMedia), ``generate_media`` prefills the chunks
    and decodes; a 3-stage split gives the whole model's tokens and logits, bit for bit."""
    text, mmproj = (str(p) for p in write_tiny_vlm(tmp_path, "qwen25vl"))
    image = (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()

    async def run(layout):
        ws = _workers(text, mmproj, layout)
        try:
            async with AsyncRoute([w.address for w in ws]) as r:
                first = r.stages[0]
                assert first.media_marker == "<__media__>" and first.media_vision
                assert not first.media_audio
                assert len(ws) == 1 or not r.stages[-1].media_marker  # the first stage's only
                chunks = await r.encode_media(f"hi {first.media_marker} what?", [image])
                assert [type(c).__name__ for c in chunks] == ["list", "MediaStep", "list"]
                assert chunks[1].n_rows == 48 and chunks[1].span == 8
                s = r.session()
                toks = [t async for t in s.generate_media(chunks, max_tokens=6, logits=True,
                                                          stop_on_eog=False)]
                return toks, [np.array(x) for x in s.logits]
        finally:
            for w in ws:
                w.stop()

    whole = asyncio.run(run([(0, 4)]))
    split = asyncio.run(run([(0, 1), (1, 3), (3, 4)]))
    assert len(whole[0]) == 6 and split[0] == whole[0]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(split[1], whole[1]))


def test_encode_media_refuses_what_it_cannot_take(tmp_path):
    text, mmproj = (str(p) for p in write_tiny_vlm(tmp_path, "gemma3"))
    image = (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()
    from dgr.worker.process import ThreadedWorker

    with pytest.raises(errors.InvalidArgument, match="beside the first stage"):
        ThreadedWorker(dgr.Engine(text, layers=(1, 4), **SETTINGS), mmproj=mmproj)

    async def go(ws, plain):
        async with AsyncRoute([w.address for w in ws]) as r:
            m = r.stages[0].media_marker
            with pytest.raises(errors.InvalidArgument, match="not an image or audio"):
                await r.encode_media(f"a {m}", [b"\x89PNG not really"])
            with pytest.raises(errors.InvalidArgument, match="media markers"):
                await r.encode_media("no marker", [image])
        async with AsyncRoute([w.address for w in plain]) as r:
            with pytest.raises(errors.InvalidArgument, match="no projector"):
                await r.encode_media("<__media__>", [image])

    ws = _workers(text, mmproj, [(0, 2), (2, 4)])
    plain = _workers(text, "", [(0, 4)])
    try:
        asyncio.run(go(ws, plain))
    finally:
        for w in ws + plain:
            w.stop()


@pytest.mark.parametrize("projector", ["qwen25vl", "gemma3"])
def test_a_next_turn_keeps_the_image_and_computes_a_fresh_prefills_bits(tmp_path, projector):
    """Turn 2 repeats turn 1's image at the same positions: ``reusable`` of its keys keeps
    the kept session's rows past the image (the same media id at each position it advances)
    and ``generate_media(reuse=...)`` prefills only the rest, with only the new chunks
    encoded (``encode_from``: the kept image comes as a ``MediaRef``); its tokens and every
    step's logits equal a fresh session's, bit for bit, on a 3-stage split. Another image at
    the same place is not reused."""
    text, mmproj = (str(p) for p in write_tiny_vlm(tmp_path, projector))
    image = (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            m = r.stages[0].media_marker
            turn1 = f"look {m} now tell me"
            s = r.session()
            reply = [t async for t in s.generate_media(
                await r.encode_media(turn1, [image]), max_tokens=5, stop_on_eog=False)]
            turn2 = turn1 + await r.detokenize(reply) + " and then more words here"
            full = await r.encode_media(turn2, [image])
            img = next(c for c in full if isinstance(c, MediaStep))
            start = len(full[0])
            reuse = s.reusable(prompt_keys(full))
            assert reuse > start + img.span, (reuse, start, img.span)
            kept = await r.encode_media(turn2, [image], encode_from=reuse)
            assert isinstance(kept[1], MediaRef) and kept[1].id == img.id
            assert kept[1].n_rows == img.n_rows and kept[1].span == img.span
            got = [t async for t in s.generate_media(kept, max_tokens=4, logits=True,
                                                     stop_on_eog=False, reuse=reuse)]
            fresh = r.session()
            want = [t async for t in fresh.generate_media(full, max_tokens=4, logits=True,
                                                          stop_on_eog=False)]
            assert got == want
            assert all(a.tobytes() == b.tobytes() for a, b in zip(s.logits, fresh.logits))
            # the same prompt with another picture keeps nothing past the text before it
            other = bytes(image[:-200]) + bytes(200)  # the pixels differ: another media id
            moved = await r.encode_media(turn2, [other])
            assert next(c for c in moved if isinstance(c, MediaStep)).id != img.id
            assert s.reusable(prompt_keys(moved)) <= start
            with pytest.raises(errors.InvalidArgument, match="inside a media step"):
                await anext(s.generate_media(full, reuse=start + 1))

    ws = _workers(text, mmproj, [(0, 1), (1, 3), (3, 4)])
    try:
        asyncio.run(go(ws))
    finally:
        for w in ws:
            w.stop()


@pytest.fixture(scope="module")
def deepstack(tmp_path_factory):
    """The generator's qwen3vl (4 layers, 256 wide) with 2 deepstack layers: its embedding
    input is 3 x 256 wide, slices 1 and 2 added to layers 0's and 1's outputs."""
    import struct

    from dgr.artifacts.gguf import _enc_str, read_header, write_gguf
    from dgr.testing import archs

    (src,) = archs.write("^qwen3vl$").files
    h = read_header(src)
    key = "qwen3vl.n_deepstack_layers"
    kv = [raw for k, raw in h.kv_raw.items() if k != key]
    kv.append(_enc_str(key) + struct.pack("<II", 4, 2))  # GGUF uint32
    out = tmp_path_factory.mktemp("deepstack") / "qwen3vl-deepstack.gguf"
    write_gguf(out, version=h.version, kv_pairs=kv, tensors=[(t, src) for t in h.tensors],
               alignment=int(h.kv.get("general.alignment", 32)))
    return str(out)


def test_deepstack_rows_split_where_the_first_stage_owns_them_and_are_refused_elsewhere(
        deepstack):
    """Qwen3-VL's media rows carry deepstack features for its first layers: a split whose
    first stage owns them computes the whole model's bits (the seam carries the residual
    only); one whose later stage owns one is refused (``uncarried``), never computed with
    zeros where the image's features belong."""
    whole = dgr.Engine(deepstack, **SETTINGS)
    assert whole.describe()["n_embd_inp"] == 3 * 256
    rng = np.random.default_rng(3)
    n = 12
    rows = rng.standard_normal((n, 3 * 256)).astype(np.float32)
    pos = np.stack([np.full(n, 2), 2 + np.arange(n) // 4, 2 + np.arange(n) % 4,
                    np.zeros(n)]).astype(np.int32)
    step = MediaStep(rows, pos, "image", id="x")
    toks = np.array([5, 6], np.int32)
    whole.forward(0, 0, tokens=toks)
    want = np.array(whole.forward_media(0, pos, rows)[-1])

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            s = r.session()
            await s.prefill(list(toks))
            return await s.prefill_media(step, sample=True, logits=True), s

    for layout in ([(0, 2), (2, 4)], [(0, 3), (3, 4)]):
        with threaded_stages(deepstack, layout, SETTINGS) as ws:
            _, s = asyncio.run(go(ws))
            assert s.logits[-1].tobytes() == want.tobytes(), layout
    with threaded_stages(deepstack, [(0, 1), (1, 4)], SETTINGS) as ws:
        with pytest.raises(errors.InvalidArgument, match="deepstack features for its first 2"):
            asyncio.run(go(ws))
    # what the refusal spares: engines cut at layer 1 compute other bits (layer 1 adds zeros)
    a = dgr.Engine(deepstack, layers=(0, 1), **SETTINGS)
    b = dgr.Engine(deepstack, layers=(1, 4), **SETTINGS)
    b.forward(0, 0, boundary=np.array(a.forward(0, 0, tokens=toks, logits="none")))
    x = np.array(a.forward_media(0, pos, rows))
    assert np.array(b.forward_media(0, pos, x)[-1]).tobytes() != want.tobytes()
