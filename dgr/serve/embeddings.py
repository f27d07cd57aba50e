"""``POST /v1/embeddings``'s request, as OpenAI's API reference has it (docs/serve.md
"Embeddings"): ``input`` (a string, a list of strings, a list of token ids, or a list of
lists of token ids), ``model``, ``encoding_format`` (``float`` or ``base64``) and ``user``.
``dimensions`` is refused: the model's width is the only one dgr computes."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from dgr.serve.api_errors import ApiError

__all__ = ["EmbeddingRequest", "parse", "MAX_INPUTS"]

#: the most inputs one request may hold (OpenAI's limit)
MAX_INPUTS = 2048
_FIELDS = {"input", "model", "encoding_format", "user", "dimensions"}


@dataclass
class EmbeddingRequest:
    #: strings or token id lists (``parse``), then token id lists (the front tokenizes)
    inputs: list
    encoding_format: str = "float"

    def encode(self, v: np.ndarray):
        """A vector as the response carries it: floats, or base64 of little-endian float32."""
        if self.encoding_format == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        return [float(x) for x in v]


def _ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse(body: dict) -> EmbeddingRequest:
    """The request of ``body``; an ``ApiError`` (400) naming the field otherwise."""
    extra = sorted(set(body) - _FIELDS)
    if extra:
        raise ApiError(400, f"Unrecognized request argument supplied: {extra[0]}",
                       param=extra[0], code="unsupported_parameter")
    if body.get("dimensions") is not None:
        raise ApiError(400, "'dimensions' is not supported: this model's embeddings have one "
                            "width", param="dimensions", code="unsupported_parameter")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be 'float' or 'base64'",
                       param="encoding_format")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", param="user")
    x = body.get("input")
    if isinstance(x, str) or _ids(x):
        inputs = [x]
    elif isinstance(x, list) and x and all(isinstance(i, str) for i in x):
        inputs = list(x)
    elif isinstance(x, list) and x and all(_ids(i) for i in x):
        inputs = list(x)
    else:
        raise ApiError(400, "'input' must be a non-empty string, a list of strings, a list of "
                            "token ids or a list of lists of token ids", param="input")
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"'input' holds {len(inputs)} inputs; at most {MAX_INPUTS}",
                       param="input")
    if any(i == "" for i in inputs):
        raise ApiError(400, "'input' cannot hold an empty string", param="input")
    return EmbeddingRequest(inputs=inputs, encoding_format=fmt)
