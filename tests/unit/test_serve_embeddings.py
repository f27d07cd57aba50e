"""``POST /v1/embeddings`` on the front, over the fuzz test's fake route: each input's rows
pooled as ``dgr.protocol.embeddings.pool`` pools them, floats or base64, a batch the same as
its inputs alone, usage counted, one slot held and given back, and every field the API
reference has either honoured or refused by name."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from dgr.protocol.embeddings import pool
from dgr.serve.app import create_app

from test_serve_fuzz import FakeRoute, FakeSession, Template, _call  # noqa: E402  (its fakes)


@pytest.fixture(params=["last"])
def front(request):
    route = FakeRoute()
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05,
                     pooling=request.param)
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())

    def call(body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return loop.run_until_complete(_call(app, "/v1/embeddings", raw))

    yield call, route, request.param
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    loop.close()


def _want(route, ids, kind):
    rows = asyncio.run(FakeSession(FakeRoute()).embed(ids))  # the fake's rows, on the side
    return [float(x) for x in pool(rows, kind)]


@pytest.mark.parametrize("front", ["last", "mean", "cls"], indirect=True)
def test_each_input_pooled_and_a_batch_as_its_inputs_alone(front):
    call, route, kind = front
    status, _, raw = call({"model": "m", "input": [[5, 9, 3], [4, 4]]})
    assert status == 200, raw
    d = json.loads(raw)
    assert d["object"] == "list" and d["model"] == "m"
    assert [e["index"] for e in d["data"]] == [0, 1]
    assert all(e["object"] == "embedding" for e in d["data"])
    assert d["data"][0]["embedding"] == _want(route, [5, 9, 3], kind)
    assert d["data"][1]["embedding"] == _want(route, [4, 4], kind)
    assert abs(np.linalg.norm(d["data"][0]["embedding"]) - 1) < 1e-6
    assert d["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    alone = json.loads(call({"input": [4, 4]})[2])["data"][0]["embedding"]
    assert alone == d["data"][1]["embedding"]
    assert route.opened == route.closed


def test_strings_are_tokenized_and_base64_is_the_same_floats(front):
    call, route, _ = front
    d = json.loads(call({"input": "hi there"})[2])
    ids = [1] + [ord(c) % 64 for c in "hi there"]  # the fake route's tokenizer
    assert d["data"][0]["embedding"] == _want(route, ids, "last")
    assert d["usage"]["prompt_tokens"] == len(ids)
    b = json.loads(call({"input": "hi there", "encoding_format": "base64"})[2])
    raw = base64.b64decode(b["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == d["data"][0]["embedding"]


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": [1, "a"]}, "input"), ({"input": {"a": 1}}, "input"), ({}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate": True}, "truncate"), ({"input": [[1, 99]]}, "input"),
    ({"input": list(range(3, 70))}, "input")])
def test_what_is_not_honoured_is_refused_by_name(front, body, param):
    call, route, _ = front
    status, _, raw = call(body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param, raw
    assert route.opened == route.closed


def test_a_failing_route_is_a_503_and_gives_its_slot_back(front):
    call, route, _ = front
    status, _, raw = call({"input": [[3, 7]]})
    assert status == 503 and json.loads(raw)["error"]["code"] == "WorkerUnavailable"
    assert route.opened == route.closed
    assert call({"input": [[3, 4]]})[0] == 200  # the slot is free again
    assert call({"input": "x", "model": "other"})[0] == 404


@pytest.mark.parametrize("value,want", [(1, "mean"), (2, "cls"), (3, "last"), (0, None),
                                        (4, None), (None, None)])
def test_the_gguf_pooling_type_is_read(monkeypatch, value, want):
    from types import SimpleNamespace

    from dgr.cli import serve

    kv = {"general.architecture": "bert"}
    if value is not None:
        kv["bert.pooling_type"] = value
    monkeypatch.setattr("dgr.artifacts.gguf.read_header", lambda path: SimpleNamespace(kv=kv))
    assert serve.gguf_pooling("m.gguf") == want


def test_an_unknown_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling"):
        create_app(FakeRoute(), model="m", pooling="max")
