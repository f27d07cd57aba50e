"""Chat templates: OpenAI-style messages to a model's prompt text, as its GGUF says.

The template is the Jinja text under ``tokenizer.chat_template`` in the GGUF metadata (read with
``dgr.artifacts.gguf.read_header``; no gguf-py at runtime). It runs the way Hugging Face
transformers runs chat templates (``_compile_jinja_template``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` tag that renders its body, the globals
``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does not escape non-ASCII
text. Attribute access the sandbox refuses raises here (jinja2 would render it as empty).

Whether the prompt's first token is the model's BOS follows llama.cpp's chat code
(``common/chat.cpp``, ``common_chat_template_direct_apply_impl``): when the vocabulary adds BOS
itself (``tokenizer.ggml.add_bos_token``) a BOS the template wrote is cut off the text, and the
text is tokenized with ``add_special`` on, so the prompt starts with exactly one BOS either way.
``render_prompt`` returns that text and the ``add_special`` flag to tokenize it with.

    t = ChatTemplate.from_gguf(path)
    text, add_bos = t.render_prompt([{"role": "user", "content": "Hi"}])
    tokens = engine.tokenize(text, add_bos, True)     # add_special, parse_special
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from dgr.artifacts.gguf import read_header
from dgr.errors import ChatTemplateError, ChatTemplateMissing, InvalidArgument

__all__ = ["TEMPLATE_KEY", "ChatTemplate", "normalize_messages"]

TEMPLATE_KEY = "tokenizer.chat_template"
TOOL_USE_KEY = "tokenizer.chat_template.tool_use"

# Variables render() sets itself; **extra may not replace them.
_RESERVED = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt", "tools"})

# tokenizer.ggml.pre values whose BPE vocabulary adds BOS when the GGUF has no
# tokenizer.ggml.add_bos_token (src/llama-vocab.cpp at the pinned commit, llama_vocab::load)
_BPE_PRE_ADD_BOS = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                              "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                              "chameleon"})


def _default_add_bos(model: str, pre: str) -> bool:
    """llama.cpp's add_bos for a vocabulary whose GGUF does not say (llama_vocab::load)."""
    if model in ("llama", "bert", "gemma4"):        # SPM, WPM; Gemma 4 forces it on
        return True
    if model == "gpt2":
        return pre in _BPE_PRE_ADD_BOS
    return False                                    # t5 (UGM), rwkv, plamo2, test, none


def _default_add_eos(model: str) -> bool:
    return model == "t5"                            # UGM adds EOS; the others do not


# ---- the Jinja environment transformers gives chat templates ----------------------------------


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker marks the
    assistant's tokens with it): renders its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing unsafe attributes loudly: jinja2's own returns an
    Undefined that renders as empty text, so ``{{ ''.__class__ }}`` would print nothing."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")


def _environment() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---- messages ---------------------------------------------------------------------------------


def _content_text(i: int, content: list) -> str:
    """Text parts joined by newlines, as llama.cpp's ``concat_content_parts`` joins them."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"messages[{i}].content[{j}] must be a text part "
                                  '{"type": "text", "text": "..."}, got '
                                  f"{_brief(part)}")
        texts.append(part["text"])
    return "\n".join(texts)


def _brief(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked copies of chat ``messages`` with every content a string.

    Each message is a dict with a ``role`` string and a ``content`` that is a string or a list
    of ``{"type": "text", "text": ...}`` parts (joined with newlines); an assistant message with
    ``tool_calls`` may have ``content`` None or absent. Other keys pass through unchanged.

    Raises
    ------
    dgr.errors.InvalidArgument
        Not a non-empty list of such dicts; the message names the offending index.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument(f"messages must be a non-empty list, got {_brief(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgument(f"messages[{i}] must be an object, got {_brief(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{i}].role must be a non-empty string, "
                                  f"got {_brief(role)}")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, str):
            pass
        elif isinstance(content, list):
            msg["content"] = _content_text(i, content)
        elif content is None and role == "assistant" and m.get("tool_calls"):
            msg["content"] = None
        else:
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text "
                                  f"parts, got {_brief(content)}")
        out.append(msg)
    return out


# ---- the template -----------------------------------------------------------------------------


def _token_text(kv: Mapping[str, Any], key: str) -> str:
    tid = kv.get(key)
    tokens = kv.get("tokenizer.ggml.tokens")
    if not isinstance(tid, int) or not isinstance(tokens, list) or not 0 <= tid < len(tokens):
        return ""
    t = tokens[tid]
    return t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)


@dataclass
class ChatTemplate:
    """A model's chat template and the special tokens it renders with.

    ``source`` is None for a model without a template (``render`` raises
    ``ChatTemplateMissing``). ``tool_use`` is the model's ``tokenizer.chat_template.tool_use``,
    used instead when tools are given (as llama.cpp does). ``add_bos``/``add_eos``: whether the
    model's vocabulary adds BOS/EOS when tokenizing with ``add_special``.
    """

    source: str | None
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    add_eos: bool = False
    tool_use: str | None = None
    name: str = "the model"
    _compiled: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, add_bos: bool | None = None,
                  add_eos: bool | None = None) -> ChatTemplate:
        """The template and BOS/EOS of the GGUF at ``path`` (a split model's first file).

        ``add_bos``/``add_eos`` default to ``tokenizer.ggml.add_bos_token``/``add_eos_token``,
        and without those keys to llama.cpp's default for the tokenizer model; a caller that
        has the loaded engine can pass its ``add_bos`` (the vocabulary's own answer) instead.

        Raises
        ------
        dgr.errors.ModelNotFound, dgr.errors.InvalidModel
            As ``read_header``.
        """
        kv = read_header(path).kv
        src = kv.get(TEMPLATE_KEY)
        tool_use = kv.get(TOOL_USE_KEY)
        model = str(kv.get("tokenizer.ggml.model", ""))
        pre = str(kv.get("tokenizer.ggml.pre", ""))
        if add_bos is None:
            v = kv.get("tokenizer.ggml.add_bos_token")
            add_bos = bool(v) if v is not None else _default_add_bos(model, pre)
        if add_eos is None:
            v = kv.get("tokenizer.ggml.add_eos_token")
            add_eos = bool(v) if v is not None else _default_add_eos(model)
        return cls(source=src if isinstance(src, str) and src else None,
                   bos_token=_token_text(kv, "tokenizer.ggml.bos_token_id"),
                   eos_token=_token_text(kv, "tokenizer.ggml.eos_token_id"),
                   add_bos=add_bos, add_eos=add_eos,
                   tool_use=tool_use if isinstance(tool_use, str) and tool_use else None,
                   name=os.path.basename(os.fspath(path)))

    @property
    def available(self) -> bool:
        """Whether the model has a chat template."""
        return self.source is not None

    def check(self) -> None:
        """Compile the template now (``ChatTemplateError`` if it does not), not at the first
        request."""
        if self.source is not None:
            self._template(self.source)

    def _template(self, src: str) -> jinja2.Template:
        t = self._compiled.get(src)
        if t is None:
            try:
                t = _environment().from_string(src)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the chat template of {self.name} has a syntax error "
                                        f"(line {e.lineno}): {e.message}") from None
            except Exception as e:  # noqa: BLE001 - whatever jinja2 raises, typed
                raise ChatTemplateError(f"the chat template of {self.name} does not compile: "
                                        f"{type(e).__name__}: {e}") from None
            self._compiled[src] = t
        return t

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, tools: list | None = None,
               **extra: Any) -> str:
        """The prompt text the template makes of ``messages`` (see ``normalize_messages``).

        ``tools`` (a list of OpenAI tool definitions, or None) and ``extra`` (further template
        variables, e.g. ``enable_thinking``) are passed to the template as they are.

        Raises
        ------
        dgr.errors.ChatTemplateMissing
            The model has no chat template.
        dgr.errors.InvalidArgument
            Bad ``messages``, ``tools``, or an ``extra`` name that ``render`` sets itself.
        dgr.errors.ChatTemplateError
            The template did not render: its ``raise_exception`` message, a syntax error, an
            attribute the sandbox refused, an undefined value, or any other failure in it.
        """
        if self.source is None:
            raise ChatTemplateMissing(f"{self.name} has no chat template ({TEMPLATE_KEY}); "
                                      "use the completions endpoint with a prompt instead")
        msgs = normalize_messages(messages)
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise InvalidArgument(f"tools must be a list, got {_brief(tools)}")
        clash = _RESERVED.intersection(extra)
        if clash:
            raise InvalidArgument(f"template variables {sorted(clash)} are set by render itself")
        src = self.tool_use if tools and self.tool_use is not None else self.source
        template = self._template(src)
        variables = dict(extra, messages=msgs, bos_token=self.bos_token,
                         eos_token=self.eos_token, add_generation_prompt=add_generation_prompt,
                         tools=list(tools) if tools is not None else None)
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise                                   # raise_exception: the template's message
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template of {self.name} was refused by the "
                                    f"sandbox: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template of {self.name} failed: "
                                    f"{type(e).__name__}: {e}") from None
        except Exception as e:  # noqa: BLE001 - e.g. a TypeError inside the template
            raise ChatTemplateError(f"the chat template of {self.name} failed: "
                                    f"{type(e).__name__}: {e}") from None

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                      add_generation_prompt: bool = True, tools: list | None = None,
                      **extra: Any) -> tuple[str, bool]:
        """``(text, add_bos)``: the rendered prompt and the ``add_special`` flag to tokenize it
        with (``parse_special`` on), so that it starts with one BOS when the model wants one.

        As llama.cpp's chat code does: when the vocabulary adds BOS, a BOS the template wrote is
        cut off the text (and a trailing EOS when it also adds EOS), and ``add_bos`` is True;
        otherwise the text is the template's as it is and ``add_bos`` is False.

        Raises
        ------
        As ``render``.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **extra)
        if not self.add_bos:
            return text, False
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text, True
