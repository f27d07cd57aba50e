"""``dgr.Media``: a model's projector (``mmproj``) through the pinned tree's libmtmd, beside
the first stage (or the whole model): a prompt with media markers cut into text and media
chunks, a media chunk's embedding rows and positions, for ``dgr.Engine.forward_media`` on
every stage. ``mtmd_helper_logits`` is llama.cpp's own path (``mtmd_helper_eval_chunks`` in a
plain llama_context), the reference a split's bits are compared with."""

from __future__ import annotations

from dgr._core import Media, mtmd_helper_logits

__all__ = ["Media", "mtmd_helper_logits"]
