"""The front's media parts (``dgr.serve.media``) without a route: each API's image shape
becomes an OpenAI ``image_url`` part, each part a marker in the text and a file in order;
what is refused is a 400 naming the part, before anything is decoded or fetched."""

from __future__ import annotations

import base64

import pytest

from dgr.serve import anthropic, responses
from dgr.serve.api_errors import ApiError
from dgr.serve.media import MediaPrompt, has_media, sniff, take_media
from dgr.driver.media import MediaRef

MARK = "<__media__>"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 32
CAPS = dict(max_media=4, max_bytes=1 << 20)


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_sniff_reads_the_bytes_not_the_declared_type():
    assert sniff(PNG) == "png" and sniff(JPEG) == "jpeg" and sniff(b"GIF89a..") == "gif"
    assert sniff(b"BM" + bytes(20)) == "bmp" and sniff(b"RIFF\0\0\0\0WAVEfmt ") == "wav"
    assert sniff(b"RIFF\0\0\0\0WEBPVP8 ") == "webp" and sniff(b"%PDF-1.7") == "pdf"
    assert sniff(b"ID3\x04") == "mp3" and sniff(b"fLaC") == "flac" and sniff(b"hello") == ""


def test_parts_become_markers_and_files_in_order():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _url(PNG), "detail": "high"}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": _url(JPEG, "image/jpeg")}]}]
    assert has_media(msgs) and not has_media(msgs[:1])
    out, media = take_media(msgs, MARK, **CAPS)
    assert out[0] == msgs[0]
    assert out[1]["content"] == [{"type": "text", "text": MARK}, {"type": "text", "text": "and"},
                                 {"type": "text", "text": MARK}]
    assert [(k, d) for k, d, _, _ in media.items] == [("image", PNG), ("image", JPEG)]
    assert msgs[1]["content"][0]["type"] == "image_url"  # the request is not changed


@pytest.mark.parametrize("part, code", [
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}},
     "image_url_not_allowed"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
     "image_url_not_allowed"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "invalid_image_url"),
    ({"type": "image_url", "image_url": {"url": "ftp://h/a.png"}}, "invalid_image_url"),
    ({"type": "image_url", "image_url": {"url": _url(b"RIFF\0\0\0\0WEBPVP8 ")}},
     "unsupported_media_type"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, None),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}, None),
    ({"type": "image_url", "image_url": {"url": _url(PNG), "detail": "max"}}, None),
    ({"type": "image_url", "image_url": {"url": _url(PNG * 40000)}}, "media_too_large"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(PNG).decode(),
                                             "format": "wav"}}, "unsupported_media_type"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}}, None),
])
def test_refusals_name_the_part(part, code):
    with pytest.raises(ApiError) as e:
        take_media([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}],
                   MARK, **CAPS)
    assert e.value.status == 400 and "messages[0].content[1]" in e.value.message
    assert code is None or e.value.code == code


def test_an_allowed_host_is_left_to_fetch_and_the_count_and_marker_are_capped():
    part = {"type": "image_url", "image_url": {"url": "http://Images.Example/a.png"}}
    _, media = take_media([{"role": "user", "content": [part]}], MARK, **CAPS,
                          url_hosts=("images.example",))
    assert media.items[0][:3] == ("image", None, "http://Images.Example/a.png")
    img = {"type": "image_url", "image_url": {"url": _url(PNG)}}
    with pytest.raises(ApiError, match="at most 4"):
        take_media([{"role": "user", "content": [img] * 5}], MARK, **CAPS)
    for content in (f"a {MARK}", [{"type": "text", "text": MARK}, img]):
        with pytest.raises(ApiError, match="media marker"):
            take_media([{"role": "user", "content": content}, {"role": "user",
                                                               "content": [img]}], MARK, **CAPS)


def test_anthropic_and_responses_images_are_openai_parts():
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look "}, {"type": "text", "text": "here"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "QUJD"}},
        {"type": "text", "text": "what?"}]}]}
    msgs = anthropic.to_chat(body)["messages"]
    assert msgs[-1]["content"] == [
        {"type": "text", "text": "look here"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
        {"type": "text", "text": "what?"}]
    body["messages"][0]["content"][2]["source"] = {"type": "file", "file_id": "f"}
    with pytest.raises(ApiError, match="an image's source"):
        anthropic.to_chat(body)
    chat = responses.to_chat({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what"},
        {"type": "input_image", "image_url": "data:image/png;base64,QUJD"}]}]})
    assert chat["messages"][-1]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD",
                                           "detail": "auto"}}
    with pytest.raises(ApiError, match="file_id"):
        responses.to_chat({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]})


def test_a_media_prompts_cells_and_positions():
    img = MediaRef("image", "abc", n_rows=48, span=8)
    p = MediaPrompt("t", [], True, 0, [[1, 2, 3], img, [4, 5]])
    assert p.cells == 3 + 48 + 2 and len(p.keys) == 3 + 8 + 2
    assert [p.cells_before(n) for n in (0, 2, 3, 11, 12, 13)] == [0, 2, 3, 51, 52, 53]
