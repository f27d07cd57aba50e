"""Images through the HTTP front with the official clients, on a 3-stage split of a tiny
random-weight VLM whose first stage runs the projector (``--mmproj``): OpenAI chat
``image_url`` (streamed and not), Anthropic ``image`` and ``document`` blocks, Responses
``input_image``; each reply's text equal to the whole model's (one stage) through the same
front, for an M-RoPE projector (qwen25vl) and a non-causal one (gemma3). A second turn that
repeats the image is served from the prompt cache (its rows counted in ``cached_tokens``)
with the text of an uncached front. Bad media are each a 400 in the API's own error shape,
never a 500 (a fuzz test too), and no request makes the server fetch from a host the
operator did not allow."""

from __future__ import annotations

import base64
import http.server
import json
import random
import threading
import urllib.error
import urllib.request

import pytest

from dgr.driver.route import AsyncRoute
from dgr.serve.settings import ServeSettings
from dgr.testing.mmproj import write_tiny_vlm
from dgr.testing.serving import Served
from dgr.vendor import Vendor

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

SETTINGS = dict(n_ctx=512, n_slots=2, n_threads=1, n_ubatch=64)
SPLIT = [(0, 1), (1, 3), (3, 4)]
NAME = "tiny-vlm"
GREEDY = dict(temperature=0)


def _image() -> bytes:
    return (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()


def _data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


class _Front:
    """Workers (the first with the projector) and a front over them."""

    def __init__(self, text, mmproj, layout, engine=None, **settings):
        from dgr.serve.app import create_app
        from dgr.serve.templates import ChatTemplate
        from dgr.worker.process import ThreadedWorker
        import dgr

        kw = {**SETTINGS, **(engine or {})}
        self.workers = [ThreadedWorker(dgr.Engine(text, layers=r, **kw),
                                       mmproj=mmproj if r[0] == 0 else "") for r in layout]
        try:
            self.served = Served(create_app(
                AsyncRoute([w.address for w in self.workers]), model=NAME,
                template=ChatTemplate.from_gguf(text), settings=ServeSettings(**settings)))
        except BaseException:
            self.stop_workers()
            raise
        self.openai = self.served.openai(timeout=120)
        self.anthropic = self.served.anthropic(timeout=120)

    def stop_workers(self):
        for w in self.workers:
            w.stop()

    def stop(self):
        self.served.stop()
        self.stop_workers()


@pytest.fixture(scope="module", params=["qwen25vl", "gemma3"])
def vlm(request, tmp_path_factory):
    text, mmproj = write_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)
    split = _Front(str(text), str(mmproj), SPLIT, prompt_cache=2)
    whole = _Front(str(text), str(mmproj), [(0, 4)], prompt_cache=0, prefix_store=False)
    yield request.param, split, whole
    split.stop()
    whole.stop()


def _ask(url: str, question: str = "What is in this picture?", detail: str = "auto") -> list:
    return [{"role": "user", "content": [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": url, "detail": detail}}]}]


def _chat(front, messages, **kw) -> tuple[str, object]:
    r = front.openai.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                             **GREEDY, **kw)
    return r.choices[0].message.content, r.usage


def test_openai_chat_with_an_image_streamed_and_not_is_the_whole_models(vlm):
    _, split, whole = vlm
    msgs = _ask(_data_url(_image()), detail="low")
    text, usage = _chat(split, msgs)
    assert text and text == _chat(whole, msgs)[0]
    assert usage.prompt_tokens > 40  # the image's rows count
    chunks = list(split.openai.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def _blocks() -> list:
    """An Anthropic user turn with a document and an image."""
    return [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "A note: the picture is a test."}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(_image()).decode()}},
            {"type": "text", "text": "Describe it."}]


def _input_image() -> list:
    """A Responses input with an image."""
    return [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": _data_url(_image()), "detail": "auto"}]}]


def test_anthropic_image_and_document_blocks(vlm):
    _, split, whole = vlm
    content = _blocks()

    def ask(front):
        m = front.anthropic.messages.create(model=NAME, max_tokens=12, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": content}])
        return m.content[0].text if m.content else "", m.usage

    text, usage = ask(split)
    assert text and (text, usage.input_tokens) == (ask(whole)[0], usage.input_tokens)
    n = split.anthropic.messages.count_tokens(model=NAME, messages=[
        {"role": "user", "content": content}]).input_tokens
    assert n == usage.input_tokens + usage.cache_read_input_tokens


def test_responses_with_an_input_image(vlm):
    _, split, whole = vlm
    inp = _input_image()

    def ask(front):
        return front.openai.responses.create(model=NAME, input=inp, max_output_tokens=12,
                                             temperature=0).output_text

    text = ask(split)
    assert text and text == ask(whole)


def test_a_repeated_image_in_turn_two_is_served_from_the_prompt_cache(vlm):
    """Turn 2 holds turn 1 (the image included) and its reply: the split front reuses the
    kept session's rows, the image's among them (``cached_tokens`` past the first text chunk
    and the image's rows), and answers the text of a front that keeps nothing."""
    _, split, whole = vlm
    turn1 = _ask(_data_url(_image()))
    reply, u1 = _chat(split, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "And its colours?"}]
    r = split.openai.chat.completions.create(model=NAME, messages=turn2, max_tokens=12, **GREEDY)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > 40, cached  # past the image's rows (48 on qwen25vl, 64 on gemma3)
    fresh = whole.openai.chat.completions.create(model=NAME, messages=turn2, max_tokens=12,
                                                 **GREEDY)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message.content == fresh.choices[0].message.content
    assert r.usage.prompt_tokens == fresh.usage.prompt_tokens
    # another image in the same place is not the kept one: nothing past the text before it
    other = _ask(_data_url(_png(8, 8)))
    r2 = split.openai.chat.completions.create(model=NAME, messages=other, max_tokens=4,
                                              **GREEDY)
    assert r2.usage.prompt_tokens_details.cached_tokens < 40


def _png(w: int, h: int) -> bytes:
    """A real w x h RGB PNG (zlib-compressed rows), for sizes the JPEG is not."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + b"".join(bytes((x * 30 % 256, y * 40 % 256, 128))
                                       for x in range(w)) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _status(front, messages, **extra) -> tuple[int, dict]:
    req = urllib.request.Request(
        front.served.base + "/v1/chat/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": NAME, "messages": messages, "max_tokens": 4,
                         **extra}).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_media_are_each_a_400_in_the_apis_shape(vlm):
    _, split, _ = vlm
    image = _image()
    cases = {
        "corrupt": _ask(_data_url(image[:100])),
        "truncated png": _ask(_data_url(_png(16, 16)[:60], "image/png")),
        "not base64": _ask("data:image/jpeg;base64,@@@@"),
        "webp": _ask(_data_url(b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 16, "image/webp")),
        "not an image": _ask(_data_url(b"hello, world", "image/png")),
        "http url": _ask("http://169.254.169.254/latest/meta-data/"),
        "file url": _ask("file:///etc/passwd"),
        "marker in text": [{"role": "user", "content": [
            {"type": "text", "text": "<__media__> twice"},
            {"type": "image_url", "image_url": {"url": _data_url(image)}}]}],
        "too many": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(image)}}] * 9}],
        "audio to a vision projector": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode(),
                "format": "wav"}}]}],
        "bad detail": _ask(_data_url(image), detail="ultra"),
    }
    for name, msgs in cases.items():
        status, body = _status(split, msgs)
        assert status == 400, (name, status, body)
        err = body["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], name
        assert "/" not in err["message"].replace("data:image/png;base64", "") or \
            "http" in name or "url" in name, (name, err)  # no path leaked
    status, body = _status(split, _ask(_data_url(image)), frequency_penalty=0.5)
    assert status == 400 and body["error"]["code"] == "unsupported_parameter", body
    # Anthropic's own shape
    with pytest.raises(anthropic.BadRequestError) as e:
        split.anthropic.messages.create(model=NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://10.0.0.1/x.png"}}]}])
    assert e.value.body["type"] == "error" and "fetches no image" in \
        e.value.body["error"]["message"]


def test_the_caps_on_bytes_and_pixels(tmp_path):
    text, mmproj = write_tiny_vlm(tmp_path, "qwen25vl")
    front = _Front(str(text), str(mmproj), [(0, 4)], max_media_bytes=4096,
                   max_image_pixels=32 * 32)
    try:
        status, body = _status(front, _ask(_data_url(_image())))
        assert status == 400 and body["error"]["code"] == "media_too_large", body
        status, body = _status(front, _ask(_data_url(_png(40, 40), "image/png")))
        assert status == 400 and "40x40" in body["error"]["message"], body
        assert body["error"]["message"].startswith("messages[0].content[1]: media item 0"), body
        status, body = _status(front, _ask(_data_url(_png(30, 30), "image/png")))
        assert status == 200, body
    finally:
        front.stop()


def test_a_front_without_a_projector_says_so(tmp_path):
    text, _ = write_tiny_vlm(tmp_path, "qwen25vl")
    front = _Front(str(text), "", [(0, 4)])
    try:
        status, body = _status(front, _ask(_data_url(_image())))
        assert status == 400 and body["error"]["code"] == "no_projector", body
        assert _status(front, [{"role": "user", "content": "hi"}])[0] == 200
    finally:
        front.stop()


def test_an_encoder_beside_the_front_gives_the_first_stages_bits(vlm, tmp_path):
    """``RouteConfig.encoder``: a worker of its own (the first layer and the projector)
    encodes for a route whose stages have none; the replies are the whole model's."""
    projector, _, whole = vlm
    text, mmproj = write_tiny_vlm(tmp_path, projector)
    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate
    from dgr.worker.process import ThreadedWorker
    import dgr

    enc = ThreadedWorker(dgr.Engine(str(text), layers=(0, 1), **SETTINGS), mmproj=str(mmproj))
    ws = [ThreadedWorker(dgr.Engine(str(text), layers=r, **SETTINGS)) for r in SPLIT]
    served = Served(create_app(AsyncRoute([w.address for w in ws], encoder=enc.address),
                               model=NAME, template=ChatTemplate.from_gguf(text)))
    try:
        c = served.openai(timeout=120)
        msgs = _ask(_data_url(_image()))
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, **GREEDY)
        assert r.choices[0].message.content == _chat(whole, msgs)[0]
        assert c.models.list().data[0].model_extra["capabilities"] == ["completion",
                                                                       "multimodal"]

        async def wrong(encoder):  # a worker that is not the first stage's model from 0
            async with AsyncRoute([w.address for w in ws], encoder=encoder):
                pass

        from dgr import errors
        import asyncio

        with pytest.raises(errors.ModelMismatch, match="from layer 1"):
            asyncio.run(wrong(ws[1].address))
        with pytest.raises(errors.RouteError, match="no projector"):
            asyncio.run(wrong(ws[0].address))
    finally:
        served.stop()
        for w in [enc, *ws]:
            w.stop()


class _Images(http.server.BaseHTTPRequestHandler):
    image = b""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.end_headers()
        self.wfile.write(self.image)

    def log_message(self, *a):
        pass


def test_an_allowed_host_is_fetched_without_redirects(tmp_path):
    text, mmproj = write_tiny_vlm(tmp_path, "qwen25vl")
    _Images.image = _image()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    front = _Front(str(text), str(mmproj), [(0, 4)], media_url_hosts=("127.0.0.1",))
    try:
        got, _ = _chat(front, _ask(base + "/test-1.jpeg"))
        assert got == _chat(front, _ask(_data_url(_image())))[0]
        status, body = _status(front, _ask(base + "/moved"))
        assert status == 400 and body["error"]["code"] == "image_url_failed", body
        status, body = _status(front, _ask(base.replace("127.0.0.1", "localhost") + "/x"))
        assert status == 400 and body["error"]["code"] == "image_url_not_allowed", body
    finally:
        front.stop()
        srv.shutdown()
        srv.server_close()


def test_fuzzed_images_are_never_a_500(vlm):
    """Random cuts, flips and splices of the JPEG and of a PNG: each a 200 or a 400."""
    _, split, _ = vlm
    rng = random.Random(55)
    seeds = [_image(), _png(16, 12)]
    for k in range(24):
        b = bytearray(rng.choice(seeds))
        op = k % 3
        if op == 0:
            b = b[:rng.randrange(1, len(b))]
        elif op == 1:
            for _ in range(rng.randrange(1, 40)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        else:
            a = rng.randrange(len(b))
            b[a:a] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        status, body = _status(split, _ask(_data_url(bytes(b))))
        assert status in (200, 400), (k, status, body)


@pytest.mark.parametrize("where", ["first", "front"])
def test_dgr_serve_mmproj_serves_images_from_the_command_line(tmp_path, where):
    """``python -m dgr serve --model M --mmproj P --stages 2``, as a user starts it, with the
    projector beside the first stage (the default) or in a worker of its own beside the front
    (``--mmproj-on front``): the model card says it is multimodal, and the official client's
    image request is answered with the text of the in-process whole model's front."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    text, mmproj = write_tiny_vlm(tmp_path, "qwen25vl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "dgr", "serve", "--model", str(text),
                              "--mmproj", str(mmproj), "--stages", "2", "--ctx", "512",
                              "--slots", "2", "--threads", "1", "--ubatch", "64",
                              "--mmproj-on", where, "--port", str(port)], stdout=f,
                             stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert p.poll() is None, log.read_text()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                                timeout=2) as r:
                        card = json.loads(r.read())["data"][0]
                    break
                except OSError:
                    assert time.monotonic() < deadline, "dgr serve did not come up"
                    time.sleep(0.3)
            assert card["capabilities"] == ["completion", "multimodal"]
            assert card["meta"]["media"] == ["image"]
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0, timeout=120) as c:
                r = c.chat.completions.create(model=card["id"], messages=_ask(
                    _data_url(_image())), max_tokens=12, temperature=0)
                got = r.choices[0].message.content
                streamed = "".join(
                    k.choices[0].delta.content or "" for k in c.chat.completions.create(
                        model=card["id"], messages=_ask(_data_url(_image())), max_tokens=12,
                        temperature=0, stream=True) if k.choices)
                resp = c.responses.create(model=card["id"], input=_input_image(),
                                          max_output_tokens=12, temperature=0).output_text
            with anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="-",
                                     max_retries=0, timeout=120) as c:
                m = c.messages.create(model=card["id"], max_tokens=12, extra_body=GREEDY,
                                      messages=[{"role": "user", "content": _blocks()}])
                claude = m.content[0].text if m.content else ""
        finally:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=120)
    assert p.returncode in (0, 130), log.read_text()
    assert ("projector qwen25vl-mmproj.gguf on this machine" in log.read_text()) == (
        where == "front")
    whole = _Front(str(text), str(mmproj), [(0, 4)])
    try:
        assert got and streamed == got == _chat(whole, _ask(_data_url(_image())))[0]
        assert resp and resp == whole.openai.responses.create(
            model=NAME, input=_input_image(), max_output_tokens=12, temperature=0).output_text
        m = whole.anthropic.messages.create(model=NAME, max_tokens=12, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": _blocks()}])
        assert claude and claude == m.content[0].text
    finally:
        whole.stop()


def test_openai_input_audio_on_an_audio_projector_is_the_whole_models(tmp_path):
    """A ``qwen2a`` projector (audio only): OpenAI chat ``input_audio`` (a WAV) through a
    3-stage split gives the whole model's text, the card says ``audio``, and an image to it
    is a 400 naming the part."""
    from dgr.testing.mmproj import write_tiny_alm, write_wav

    text, mmproj = (str(p) for p in write_tiny_alm(tmp_path))
    wav = base64.b64encode(write_wav(tmp_path / "tone.wav").read_bytes()).decode()
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "What is this sound?"},
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]
    fronts = []
    try:
        for layout in (SPLIT, [(0, 4)]):
            fronts.append(_Front(text, mmproj, layout, engine={"n_ctx": 1024}, prompt_cache=0))
        split, whole = fronts
        got, usage = _chat(split, msgs)
        assert got and got == _chat(whole, msgs)[0]
        assert usage.prompt_tokens > 750  # the clip's 750 rows count
        assert split.openai.models.list().data[0].model_extra["meta"]["media"] == ["audio"]
        status, body = _status(split, _ask(_data_url(_image())))
        assert status == 400 and body["error"]["code"] == "unsupported_media", body
        assert "takes no images" in body["error"]["message"]
    finally:
        for f in fronts:
            f.stop()
