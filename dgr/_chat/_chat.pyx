# distutils: language = c++
"""llama.cpp's chat templates and tool-call parsers (cpp/include/dgr/chat.h), JSON in and out."""

import json

from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string


cdef extern from "dgr/chat.h" namespace "dgr" nogil:
    cdef cppclass CChatTemplate "dgr::ChatTemplate":
        CChatTemplate(const string&, const string&, const string&, const string&, bool,
                      bool) except +
        string apply(const string&) except +
        string caps() except +

    cdef cppclass CChatParser "dgr::ChatParser":
        CChatParser(const string&) except +
        string update(const string&, bool) except +


cdef bytes _utf8(s):
    return s.encode("utf-8", "surrogatepass")


cdef class ChatTemplate:
    """A model's chat template as llama-server renders it (``common_chat_templates_apply``).

    ``source`` is the Jinja text; ``tool_use`` the model's tool-use template or None. Raises
    RuntimeError when the template does not parse."""

    cdef unique_ptr[CChatTemplate] _t

    def __init__(self, str source, tool_use=None, str bos="", str eos="", add_bos=False,
                 add_eos=False):
        cdef string src = _utf8(source)
        cdef string tu = _utf8(tool_use or "")
        cdef string b = _utf8(bos)
        cdef string e = _utf8(eos)
        cdef bool ab = True if add_bos else False
        cdef bool ae = True if add_eos else False
        with nogil:
            self._t.reset(new CChatTemplate(src, tu, b, e, ab, ae))

    def apply(self, dict request):
        """The prompt, grammar, triggers, stops and parser for ``request`` (see chat.h).
        ValueError: a bad request; RuntimeError: the template failed."""
        cdef string req = _utf8(json.dumps(request, ensure_ascii=False))
        cdef string out
        with nogil:
            out = self._t.get().apply(req)
        return json.loads(out.decode("utf-8", "replace"))

    def caps(self):
        """The template's capabilities as llama.cpp detects them."""
        return json.loads(self._t.get().caps().decode("utf-8"))


cdef class ChatParser:
    """One reply's parser: ``update(text, partial)`` appends ``text`` and returns the parsed
    message so far and its diffs (see chat.h)."""

    cdef unique_ptr[CChatParser] _p

    def __init__(self, dict params):
        cdef string p = _utf8(json.dumps(params, ensure_ascii=False))
        with nogil:
            self._p.reset(new CChatParser(p))

    def update(self, str text, bint partial):
        cdef string t = _utf8(text)
        cdef string out
        with nogil:
            out = self._p.get().update(t, partial)
        return json.loads(out.decode("utf-8", "replace"))
