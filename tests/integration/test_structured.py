"""Constrained decoding on a split route (dgr.protocol.grammar, dgr.worker.grammar): the
output follows the grammar, and the tokens are the whole model's under the same grammar,
with speculation as without, and batched as alone."""

from __future__ import annotations

import asyncio
import json

import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import AsyncRoute, Route
from dgr.protocol.grammar import compile_grammar
from dgr.protocol.sampling import SamplingParams
from dgr.worker.process import ThreadedWorker
from dgr.worker.speculation import FixedDraftPolicy

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=512, n_slots=4, n_threads=1, n_ubatch=32)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stages(smollm2):
    ws = [ThreadedWorker(dgr.Engine(smollm2, layers=r, **SETTINGS), evict_after=3600.0)
          for r in ((0, 15), (15, 30))]
    ws[-1].worker.pipeline.speculator.policy = FixedDraftPolicy()  # draft whatever the tokens allow
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def whole(smollm2):
    return dgr.Engine(smollm2, **SETTINGS)


def _prompt(route, text):
    return [int(t) for t in route.tokenize(CHAT.format(text), True, True)]


def test_json_schema_output_validates_and_is_the_whole_models(stages, whole):
    sp = SamplingParams(grammar=compile_grammar("json_schema", SCHEMA))
    with Route([w.address for w in stages]) as r:
        ids = _prompt(r, "Describe a person called Ann who is 30 and has a cat, as JSON.")
        g = r.complete(ids, max_tokens=80, sampling=sp)
        free = r.complete(ids, max_tokens=80)
    jsonschema.validate(json.loads(g.text), SCHEMA)
    assert g.stop_reason == "eos" and g.text != free.text
    ref, _ = generate_local(whole, ids, max_tokens=80, sampling=sp)
    assert g.tokens == ref


def test_a_gbnf_grammar_and_a_regex_bound_the_answer(stages):
    with Route([w.address for w in stages]) as r:
        ids = _prompt(r, "Is the sky green? Answer yes or no.")
        yn = r.complete(ids, max_tokens=8, sampling=SamplingParams(
            grammar=compile_grammar("gbnf", 'root ::= ("yes" | "no") "."')))
        digits = r.complete(ids, max_tokens=8, sampling=SamplingParams(
            temperature=1.0, seed=3, grammar=compile_grammar("regex", "[0-9]{3}")))
    assert yn.text in ("yes.", "no.") and yn.stop_reason == "eos"
    assert len(digits.text) == 3 and digits.text.isdigit()


def test_speculation_verifies_drafts_under_the_grammar(stages):
    """Drafts are consumed to mask their rows and rolled back when rejected: the tokens are
    plain decoding's under the same grammar."""
    schema = {"type": "array", "minItems": 6, "maxItems": 6,
              "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                          "ok": {"type": "boolean"}},
                        "required": ["id", "ok"], "additionalProperties": False}}
    sp = SamplingParams(grammar=compile_grammar("json_schema", schema))
    addrs = [w.address for w in stages]
    with Route(addrs) as r:
        ids = _prompt(r, "List six records with ids 1 to 6, all ok, as a JSON array.")
        plain = r.complete(ids, max_tokens=120, sampling=sp)
    with Route(addrs, relay=True, speculate="ngram") as r:
        g = r.complete(ids, max_tokens=120, sampling=sp)
    assert g.tokens == plain.tokens and g.drafted > 0
    jsonschema.validate(json.loads(g.text), schema)


def test_constrained_sessions_batched_make_their_own_tokens(stages, whole):
    schemas = [SCHEMA, {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
               {"enum": ["red", "green", "blue"]}]
    sps = [SamplingParams(grammar=compile_grammar("json_schema", s)) for s in schemas]

    async def go():
        async with AsyncRoute([w.address for w in stages]) as r:
            ids = [[int(t) for t in await r.tokenize(CHAT.format(q), True, True)]
                   for q in ("A person as JSON.", "Some numbers.", "A colour.")]
            gens = await asyncio.gather(*(r.complete(i, max_tokens=60, sampling=sp)
                                          for i, sp in zip(ids, sps)))
            return ids, gens

    ids, gens = asyncio.run(go())
    for i, g, sp, schema in zip(ids, gens, sps, schemas):
        jsonschema.validate(json.loads(g.text), schema)
        ref, _ = generate_local(whole, i, max_tokens=60, sampling=sp)
        assert g.tokens == ref


def test_a_kept_session_serves_constrained_requests_again(stages, whole):
    """A session kept after a constrained reply (the front's prompt cache) serves the next
    constrained prompt with what it may keep (``generate``'s ``reuse``) and gives the whole
    model's tokens under the grammar: the last stage's grammar state starts again where the
    new reply starts, also where the last one started (the same prompt again: the same
    epoch, grammar and start)."""
    sp = SamplingParams(grammar=compile_grammar("json_schema", SCHEMA))
    with Route([w.address for w in stages]) as r:
        # over one whole chunk (n_ubatch 32): the next turn keeps it
        ids = _prompt(r, "Describe a person called Ann, who is 30 years old and has a cat "
                         "called Tom and a fish, as a JSON object with her details.")
        s = r.session()
        try:
            first = list(s.generate(ids, max_tokens=80, sampling=sp))
            keep = s.reusable(ids)
            again = list(s.generate(ids, max_tokens=80, sampling=sp, reuse=keep))
            nxt = list(s.history) + _prompt(r, "Now Bob, 40, with a dog.")
            keep2 = s.reusable(nxt)
            third = list(s.generate(nxt, max_tokens=80, sampling=sp, reuse=keep2))
        finally:
            s.close()
        text = r.detokenize([t for t in third if t not in r.eog_tokens])
    ref, _ = generate_local(whole, ids, max_tokens=80, sampling=sp)
    assert keep > 0 and first == ref and again == ref
    ref3, _ = generate_local(whole, nxt, max_tokens=80, sampling=sp)
    assert len(ids) > 32 and keep2 >= 32 and third == ref3
    jsonschema.validate(json.loads(text), SCHEMA)
