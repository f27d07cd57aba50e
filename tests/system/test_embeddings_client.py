"""``POST /v1/embeddings`` with the official ``openai`` client's ``embeddings.create``, on a
2-stage SmolLM2 route: the vectors are the whole model's (one engine, its rows pooled the same
way: the last token's, unit length) bit for bit, as floats and as base64; a batch gives the
rows of its inputs sent alone; a prompt longer than a chunk works; usage counts the tokens."""

from __future__ import annotations

import base64

import numpy as np
import pytest

import dgr
from dgr.driver.route import AsyncRoute
from dgr.protocol.embeddings import pool
from dgr.testing.serving import Served


openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

NAME = "smollm2"
SETTINGS = dict(n_ctx=2048, n_slots=2, n_threads=1, n_ubatch=64)  # stages (conftest)

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.",
         " ".join(["A prompt longer than one chunk of sixty-four tokens."] * 8)]


@pytest.fixture(scope="module")
def client(stages):
    from dgr.serve.app import create_app

    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME))
    yield served.openai(timeout=120)
    served.stop()


@pytest.fixture(scope="module")
def whole(smollm2):
    """The whole model's vectors: one engine, the same chunks, the same pooling."""
    e = dgr.Engine(smollm2, **SETTINGS)
    out = []
    for text in TEXTS:
        ids = e.tokenize(text, True, True)
        rows = np.concatenate([e.embed(0, a, ids[a:a + 64]) for a in range(0, len(ids), 64)])
        e.release(0)
        out.append((len(ids), pool(rows, "last").tolist()))
    return out


def test_a_split_route_embeds_as_the_whole_model_bit_for_bit(client, whole):
    assert whole[2][0] > 64  # the long prompt spans chunks
    # the client's default asks for base64 and decodes it; float and base64 as asked
    for fmt in (None, "float", "base64"):
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = client.embeddings.create(model=NAME, input=TEXTS, **kw)
        assert [d.index for d in r.data] == [0, 1, 2]
        for d, (_, ref) in zip(r.data, whole):
            v = d.embedding
            if fmt == "base64":  # the client hands base64 asked for back as it came
                v = np.frombuffer(base64.b64decode(v), "<f4").tolist()
            assert v == ref  # the same floats, every bit
            assert len(v) == 576 and abs(np.linalg.norm(v) - 1) < 1e-5
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(n for n, _ in whole)


def test_a_batch_gives_its_inputs_rows_alone(client):
    batch = client.embeddings.create(model=NAME, input=TEXTS[:2]).data
    for text, d in zip(TEXTS[:2], batch):
        alone = client.embeddings.create(model=NAME, input=text).data[0]
        assert alone.embedding == d.embedding
    ids = client.embeddings.create(model=NAME, input=[[1, 504, 3458]]).data[0].embedding
    assert len(ids) == 576


def test_unsupported_fields_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input="x", dimensions=64)
    assert "dimensions" in str(e.value)
