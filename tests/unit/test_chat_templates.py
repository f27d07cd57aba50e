"""Chat templates (dgr.serve.templates) on small header-only GGUFs: rendering, BOS, typed errors."""

from __future__ import annotations

import struct

import pytest

from dgr import errors
from dgr.artifacts import gguf
from dgr.serve.templates import ChatTemplate, normalize_messages

# a ChatML template in the style of SmolLM2 / Qwen, with a BOS the template writes itself
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOKENS = ["<unk>", "<s>", "</s>", "a", "b"]


def _string_array(key: str, items: list[str]) -> bytes:
    def s(x: str) -> bytes:
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    return (s(key) + struct.pack("<I", gguf.T_ARRAY)
            + struct.pack("<IQ", gguf.T_STRING, len(items)) + b"".join(s(t) for t in items))


def _write(path, template: str | None = CHATML, *, add_bos: bool | None = True,
           model: str = "llama", pre: str | None = None):
    """A GGUF with tokenizer metadata only (no tensors): what ChatTemplate.from_gguf reads."""
    kv = [gguf.encode_kv("general.architecture", gguf.T_STRING, "llama"),
          gguf.encode_kv("tokenizer.ggml.model", gguf.T_STRING, model),
          _string_array("tokenizer.ggml.tokens", TOKENS),
          gguf.encode_kv("tokenizer.ggml.bos_token_id", gguf.T_U32, 1),
          gguf.encode_kv("tokenizer.ggml.eos_token_id", gguf.T_U32, 2)]
    if pre is not None:
        kv.append(gguf.encode_kv("tokenizer.ggml.pre", gguf.T_STRING, pre))
    if add_bos is not None:
        kv.append(gguf.encode_kv("tokenizer.ggml.add_bos_token", 7, add_bos))  # 7: bool
    if template is not None:
        kv.append(gguf.encode_kv("tokenizer.chat_template", gguf.T_STRING, template))
    gguf.write_gguf(path, version=3, kv_pairs=kv, tensors=[], alignment=32)
    return path


HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chatml_renders_exactly_with_and_without_generation_prompt(tmp_path):
    t = ChatTemplate.from_gguf(_write(tmp_path / "m.gguf"))
    assert (t.bos_token, t.eos_token, t.add_bos) == ("<s>", "</s>", True)
    body = "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert t.render(HELLO) == body + "<|im_start|>assistant\n"
    assert t.render(HELLO, add_generation_prompt=False) == body


def test_list_of_text_parts_is_joined_with_newlines(tmp_path):
    t = ChatTemplate.from_gguf(_write(tmp_path / "m.gguf"))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                         {"type": "text", "text": "two"}]}]
    assert t.render(msgs, add_generation_prompt=False) == "<s><|im_start|>user\none\ntwo<|im_end|>\n"
    assert msgs[0]["content"][0] == {"type": "text", "text": "one"}   # the caller's list kept


def test_render_prompt_leaves_one_bos_to_whoever_adds_it(tmp_path):
    """A vocabulary that adds BOS: the template's BOS is cut and add_special is on. One that
    does not: the template's text as it is, add_special off (llama.cpp common/chat.cpp)."""
    adds = ChatTemplate.from_gguf(_write(tmp_path / "a.gguf", add_bos=True))
    text, add_bos = adds.render_prompt(HELLO)
    assert add_bos is True and text == adds.render(HELLO)[len("<s>"):]
    assert not text.startswith("<s>")
    keeps = ChatTemplate.from_gguf(_write(tmp_path / "k.gguf", add_bos=False))
    text, add_bos = keeps.render_prompt(HELLO)
    assert add_bos is False and text == keeps.render(HELLO) and text.startswith("<s>")
    # the engine's own answer overrides the file's key
    over = ChatTemplate.from_gguf(tmp_path / "k.gguf", add_bos=True)
    assert over.render_prompt(HELLO) == (keeps.render(HELLO)[3:], True)


@pytest.mark.parametrize("model,pre,want", [("llama", None, True), ("gpt2", "smollm", False),
                                            ("gpt2", "llama-bpe", True), ("t5", None, False)])
def test_add_bos_without_the_key_follows_llama_cpp_defaults(tmp_path, model, pre, want):
    t = ChatTemplate.from_gguf(_write(tmp_path / "m.gguf", add_bos=None, model=model, pre=pre))
    assert t.add_bos is want


def test_missing_template_raises_typed(tmp_path):
    t = ChatTemplate.from_gguf(_write(tmp_path / "m.gguf", template=None))
    assert not t.available
    with pytest.raises(errors.ChatTemplateMissing, match="m.gguf has no chat template"):
        t.render(HELLO)
    with pytest.raises(errors.ChatTemplateMissing):
        t.render_prompt(HELLO)
    assert issubclass(errors.ChatTemplateMissing, errors.ChatTemplateError)


def test_raise_exception_gives_the_templates_message():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                     "{{ raise_exception('Conversations must start with a user message') }}"
                     "{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(errors.ChatTemplateError) as ei:
        t.render([{"role": "assistant", "content": "x"}])
    assert str(ei.value) == "Conversations must start with a user message"


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",                    # jinja2 alone would render this as empty text
    "{{ messages.__class__.__base__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append(1) }}",              # the immutable sandbox: no mutation either
])
def test_sandbox_escape_is_refused_not_evaluated(src):
    with pytest.raises(errors.ChatTemplateError, match="unsafe") as ei:
        ChatTemplate(src).render([{"role": "user", "content": "x"}])
    assert "<class" not in str(ei.value)


@pytest.mark.parametrize("src,match", [
    ("{% for m in messages %}{{ m.content }}", "syntax error"),
    ("{{ nothing.here }}", "UndefinedError"),
    ("{{ 1 + 'a' }}", "TypeError"),
])
def test_a_template_that_fails_raises_typed(src, match):
    with pytest.raises(errors.ChatTemplateError, match=match):
        ChatTemplate(src).render([{"role": "user", "content": "x"}])


def test_transformers_globals_and_filters():
    t = ChatTemplate("{{ messages[0]|tojson }}|{{ {'a': [1]}|tojson(indent=2) }}|"
                     "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
                     "{{ m.content }}{% endfor %}|{{ strftime_now('%Y') | length }}|"
                     "{% generation %}g{% endgeneration %}|{{ tools|tojson }}|{{ extra }}")
    out = t.render([{"role": "user", "content": "é"}, {"role": "user", "content": "b"}],
                   extra="E")
    assert out == ('{"role": "user", "content": "é"}|{\n  "a": [\n    1\n  ]\n}|b|4|g|null|E')


@pytest.mark.parametrize("messages,where", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\].role"),
    ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\].role"),
    ([{"role": "user", "content": 7}], r"messages\[0\].content must be"),
    ([{"role": "user"}], r"messages\[0\].content must be"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "a"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[2\].content\[0\] must be a text part"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}],
     r"messages\[0\].content\[0\]"),
])
def test_bad_messages_name_the_index(messages, where):
    t = ChatTemplate(CHATML)
    with pytest.raises(errors.InvalidArgument, match=where):
        t.render(messages)


def test_other_bad_arguments_are_typed():
    t = ChatTemplate(CHATML)
    with pytest.raises(errors.InvalidArgument, match="tools must be a list"):
        t.render(HELLO, tools="x")
    with pytest.raises(errors.InvalidArgument, match="bos_token"):
        t.render(HELLO, bos_token="<x>")


def test_assistant_tool_calls_may_have_no_content():
    msgs = normalize_messages([{"role": "user", "content": "q"},
                               {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "1", "type": "function"}]}])
    assert msgs[1]["content"] is None and msgs[1]["tool_calls"][0]["id"] == "1"
    with pytest.raises(errors.InvalidArgument, match=r"messages\[0\]"):
        normalize_messages([{"role": "user", "content": None}])
