"""An image through dgr's engines (dgr.Media: the pinned tree's libmtmd beside the first
stage; Engine.forward_media on every stage): the whole model's last logits equal llama.cpp's
own path (mtmd_helper_eval_chunks in a plain llama_context) bit for bit, and a split's equal
the whole model's at every 2-stage cut and a 3-stage layout, for an M-RoPE projector
(Qwen2.5-VL, Qwen2-VL: an image's rows take (t, y, x, z) positions across every seam) and a
non-causal one (Gemma 3: the image's rows attend both ways on every stage), with sessions
batched beside each other, and the checks would see a wrong position or causality; and audio
(a Qwen2-Audio projector's rows) the same way."""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.core.media import Media, mtmd_helper_logits
from dgr.testing.mmproj import write_tiny_vlm
from dgr.vendor import Vendor

SETTINGS = dict(n_ctx=512, n_threads=1, n_ubatch=64)
LAYOUTS = [[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 3), (3, 4)], [(0, 1), (1, 3), (3, 4)]]


@pytest.fixture(scope="module")
def image() -> bytes:
    return (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()


@pytest.fixture(scope="module", params=["qwen25vl", "qwen2vl", "gemma3"])
def vlm(request, tmp_path_factory):
    text, mmproj = write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, str(text), str(mmproj)


def _route(text, layouts, **kw):
    return [dgr.Engine(text, layers=r, **{**SETTINGS, **kw}) for r in layouts]


def _step(engines, slot, chunk, pos, rows=None, *, causal=None):
    """One chunk through every stage: a text chunk's tokens, or a media chunk's rows."""
    x = rows
    for e in engines:
        if rows is None:
            toks = np.asarray(chunk["tokens"], dtype=np.int32)
            x = e.forward(slot, pos, tokens=toks if e.is_first else None,
                          boundary=None if e.is_first else x)
        else:
            c = not chunk["non_causal"] if causal is None else causal
            x = e.forward_media(slot, pos, x, causal=c)
    return x


def _run(engines, media, prompt, images, slot=0, *, flat=False, causal=None):
    """``prompt``'s chunks through the route from position 0: the last row's logits. ``flat``
    gives an M-RoPE image its text positions (a wrong run), ``causal`` forces the causality."""
    chunks = media.tokenize(prompt, images)
    p, out = 0, None
    for i, c in enumerate(chunks):
        if c["kind"] == "text":
            out = _step(engines, slot, c, p)
        else:
            pos = (np.arange(p, p + c["n_rows"], dtype=np.int32) if flat
                   else media.positions(i, p))
            out = _step(engines, slot, c, pos, media.encode(i), causal=causal)
        p += c["n_rows"] if flat else c["n_pos"]
    return chunks, out[-1]


def test_the_whole_model_is_llama_cpps_own_mtmd_path_and_every_split_is_the_whole(vlm, image):
    projector, text, mmproj = vlm
    whole = _route(text, [None])
    media = Media(whole[0], mmproj)
    prompt = f"hello there {media.marker} what is in it?"
    chunks, got = _run(whole, media, prompt, [image])
    kinds = [c["kind"] for c in chunks]
    assert kinds == ["text", "image", "text"]
    img = chunks[1]
    if projector == "gemma3":
        assert img["n_rows"] == img["n_pos"] == 36 and img["non_causal"] and not media.mrope
    else:  # 8 x 6 merged patches; M-RoPE positions advance max(8, 6)
        assert img["n_rows"] == 48 and img["n_pos"] == 8 and media.mrope
        assert not img["non_causal"]
    assert len(img["id"]) == 64  # the SHA-256 of the file's bytes, mtmd's bitmap id
    ref = mtmd_helper_logits(text, mmproj, prompt, [image], **SETTINGS)
    assert got.tobytes() == ref.tobytes()
    for layout in LAYOUTS:
        route = _route(text, layout)
        _, split = _run(route, Media(route[0], mmproj), prompt, [image])
        assert split.tobytes() == got.tobytes(), layout
    # the check sees what the image step's positions and causality change
    for e in whole:
        e.release(0)
    wrong = (_run(whole, media, prompt, [image], causal=True)[1] if projector == "gemma3"
             else _run(whole, media, prompt, [image], flat=True)[1])
    assert wrong.tobytes() != got.tobytes()


def test_sessions_with_and_without_images_beside_each_other_are_each_alone(vlm, image):
    """Four sessions on one 2-stage route of four slots, two with the image, their steps
    interleaved: each one's logits are its own alone."""
    _, text, mmproj = vlm
    route = _route(text, [(0, 2), (2, 4)], n_slots=4)
    media = Media(route[0], mmproj)
    prompts = [(f"look {media.marker} here", [image]), ("plain words only", []),
               (f"{media.marker} and then", [image]), ("more plain words", [])]
    plans = []
    for prompt, images in prompts:
        chunks = media.tokenize(prompt, images)
        starts = np.cumsum([0] + [c["n_pos"] for c in chunks])
        rows = {i: (media.encode(i), media.positions(i, int(starts[i])))
                for i, c in enumerate(chunks) if c["kind"] != "text"}
        plans.append((chunks, rows))
    # the same steps, round-robin over the four slots
    pos, last = [0] * 4, [None] * 4
    for k in range(max(len(c) for c, _ in plans)):
        for s, (chunks, rows) in enumerate(plans):
            if k >= len(chunks):
                continue
            c = chunks[k]
            if c["kind"] == "text":
                last[s] = _step(route, s, c, pos[s])[-1]
            else:
                r, p = rows[k]
                last[s] = _step(route, s, c, p, r)[-1]
            pos[s] += c["n_pos"]
    for s, (prompt, images) in enumerate(prompts):
        alone = _route(text, [(0, 2), (2, 4)])
        _, want = _run(alone, Media(alone[0], mmproj), prompt, images)
        assert last[s].tobytes() == want.tobytes(), s


def test_bad_media_and_bad_steps_are_refused_with_clear_errors(tmp_path, image):
    text, mmproj = write_tiny_vlm(tmp_path, "qwen25vl")
    whole = _route(str(text), [None])
    media = Media(whole[0], str(mmproj))
    with pytest.raises(errors.InvalidArgument, match="not an image or audio file"):
        media.tokenize(f"a {media.marker}", [b"not an image at all"])
    with pytest.raises(errors.InvalidArgument, match="not an image or audio file"):
        media.tokenize(f"a {media.marker}", [image[:20]])  # cut inside its header
    with pytest.raises(errors.InvalidArgument, match="number of media markers"):
        media.tokenize("no marker here", [image])
    with pytest.raises(errors.InvalidArgument, match="not a media chunk"):
        media.tokenize("just text", [])
        media.encode(0)
    chunks = media.tokenize(f"x {media.marker}", [image])
    rows, pos = media.encode(1), media.positions(1, 0)
    with pytest.raises(errors.InvalidBoundary, match="shape"):
        whole[0].forward_media(0, pos, rows[:, :-1])
    with pytest.raises(errors.InvalidPosition, match="sections"):
        whole[0].forward_media(0, pos[:2], rows)
    with pytest.raises(errors.InvalidPosition, match="continues at position 0"):
        whole[0].forward_media(0, pos + 5, rows)
    assert chunks[1]["n_rows"] == 48
    with pytest.raises(errors.InvalidArgument, match="first stage"):
        Media(dgr.Engine(str(text), layers=(1, 4), **SETTINGS), str(mmproj))
    with pytest.raises(errors.InvalidModel, match="projector"):
        Media(whole[0], str(text))  # a text model, not a projector
    g_text, g_mm = write_tiny_vlm(tmp_path / "g", "gemma3")
    g = _route(str(g_text), [None], n_ubatch=16)
    gm = Media(g[0], str(g_mm))
    gm.tokenize(f"x {gm.marker}", [image])
    with pytest.raises(errors.InvalidArgument, match="one chunk"):  # 36 rows, n_ubatch 16
        g[0].forward_media(0, gm.positions(1, 0), gm.encode(1), causal=False)


def test_corrupt_images_are_refused_or_decoded_never_a_crash(tmp_path, image):
    """Fuzz: the pinned test image with bytes flipped, runs zeroed, cut short or spliced, and
    random bytes: libmtmd (stb_image) decodes each or refuses it with InvalidArgument; a
    decoded one encodes to finite rows of the image's shape. Nothing crashes or leaks a
    C++ exception."""
    text, mmproj = write_tiny_vlm(tmp_path, "gemma3")  # fixed-size images: 36 rows each
    engine = dgr.Engine(str(text), **SETTINGS)
    media = Media(engine, str(mmproj))
    rng = np.random.default_rng(55)
    outcomes = {"refused": 0, "decoded": 0}
    for k in range(120):
        b = bytearray(image)
        how = k % 5
        if how == 0:
            for i in rng.integers(0, len(b), 1 + k % 7):
                b[i] ^= 1 << int(rng.integers(0, 8))
        elif how == 1:
            a = int(rng.integers(0, len(b)))
            b[a:a + int(rng.integers(1, 4096))] = bytes(min(4096, len(b) - a))
        elif how == 2:
            b = b[:int(rng.integers(1, len(b)))]
        elif how == 3:
            a = int(rng.integers(0, len(b)))
            b = b[:a] + bytearray(rng.integers(0, 256, int(rng.integers(1, 512)), np.uint8))
        else:
            b = bytearray(rng.integers(0, 256, int(rng.integers(1, 2048)), np.uint8))
        try:
            chunks = media.tokenize(f"a {media.marker} b", [bytes(b)])
        except errors.InvalidArgument:
            outcomes["refused"] += 1
            continue
        outcomes["decoded"] += 1
        i = next(j for j, c in enumerate(chunks) if c["kind"] == "image")
        rows = media.encode(i)
        assert rows.shape == (36, media.n_embd_inp) and np.isfinite(rows).all()
    assert outcomes["refused"] >= 20 and outcomes["decoded"] >= 20, outcomes


def test_audio_through_dgr_is_llama_cpps_own_path_and_every_split_is_the_whole(tmp_path):
    """A Qwen2-Audio-style projector (``qwen2a``: a Whisper encoder over a 30-second window,
    750 rows) beside an M-RoPE text model: a 1-second WAV's prompt gives llama.cpp's own
    mtmd_helper_eval_chunks logits bit for bit through dgr, and every split the whole's."""
    from dgr.testing.mmproj import write_tiny_alm, write_wav

    text, mmproj = (str(p) for p in write_tiny_alm(tmp_path))
    wav = write_wav(tmp_path / "tone.wav").read_bytes()
    whole = _route(text, [None], n_ctx=1024)
    media = Media(whole[0], mmproj)
    assert media.audio and not media.vision and media.audio_sample_rate == 16000
    prompt = f"listen {media.marker} what is it?"
    chunks, got = _run(whole, media, prompt, [wav])
    assert [c["kind"] for c in chunks] == ["text", "audio", "text"]
    assert chunks[1]["n_rows"] == chunks[1]["n_pos"] == 750 and len(chunks[1]["id"]) == 64
    ref = mtmd_helper_logits(text, mmproj, prompt, [wav], **{**SETTINGS, "n_ctx": 1024})
    assert got.tobytes() == ref.tobytes()
    for layout in LAYOUTS:
        route = _route(text, layout, n_ctx=1024)
        _, split = _run(route, Media(route[0], mmproj), prompt, [wav])
        assert split.tobytes() == got.tobytes(), layout
    with pytest.raises(errors.InvalidArgument, match="an image, which this projector"):
        media.tokenize(prompt, [(Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()])
