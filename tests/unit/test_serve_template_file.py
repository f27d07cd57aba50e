"""``python -m dgr serve --chat-template-file``: llama-server's flag. A model without a chat
template (the generator's fixtures) gets one; a model's own is overridden, its BOS/EOS kept; a
missing or broken file is refused before any worker starts."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from dgr import errors
from dgr.cli import serve

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _parsed(*argv):
    p = argparse.ArgumentParser()
    serve.add_serve_parser(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_the_flag_is_parsed_and_its_file_read_and_compiled(tmp_path):
    f = tmp_path / "chatml.jinja"
    f.write_text(CHATML)
    assert serve._template_file(_parsed("--chat-template-file", str(f))) == CHATML
    assert serve._template_file(_parsed()) is None
    with pytest.raises(errors.InvalidArgument, match="--chat-template-file .*missing"):
        serve._template_file(_parsed("--chat-template-file", str(tmp_path / "missing")))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(errors.ChatTemplateError, match="bad.jinja"):
        serve._template_file(_parsed("--chat-template-file", str(bad)))


def test_the_file_replaces_the_models_template_and_keeps_its_tokens(tiny_llama, monkeypatch,
                                                                    tmp_path):
    """The front renders chats with the file's template over a model (with or without one of
    its own) and over a ``--route`` without ``--model``."""
    got = {}
    monkeypatch.setattr("dgr.serve.app.create_app", lambda route, **kw: got.update(kw))
    monkeypatch.setattr("dgr.driver.route.AsyncRoute", lambda *a, **k: SimpleNamespace())
    f = tmp_path / "chatml.jinja"
    f.write_text(CHATML)
    args = _parsed("--chat-template-file", str(f), "--pooling", "last")
    front = SimpleNamespace(with_=lambda **kw: front)
    for model in (str(tiny_llama), None):
        serve._app(args, model, "m", ["127.0.0.1:1"], [], front, CHATML)
        t = got["template"]
        assert t.source == CHATML and t.name == "chatml.jinja" and t.available
        text = t.render([{"role": "user", "content": "hi"}])
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
