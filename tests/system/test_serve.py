"""The OpenAI-compatible HTTP front (dgr.serve) over a real 2-stage SmolLM2 route, driven by
the official ``openai`` client: models, chat and completions (streamed and not), stop strings,
usage, the greedy text equal to the route's own greedy output, the error shapes and statuses,
the queue for slots (503 past its deadline, 429 full), a client that disconnects mid-stream (its sessions released), API keys,
and one key at its cap of requests in flight while another key's generation is served."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from dgr.driver.route import AsyncRoute, Route
from dgr.testing.serving import Served
from dgr.testing.waits import wait_until

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

SETTINGS = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=32)
NAME = "smollm2"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def template(smollm2):
    from dgr.serve.templates import ChatTemplate

    return ChatTemplate.from_gguf(smollm2)


def _serve(stages, template, **kw):
    from dgr.serve.app import create_app

    app = create_app(AsyncRoute([w.address for w in stages]), model=NAME, template=template,
                     **kw)
    return Served(app)


@pytest.fixture(scope="module")
def served(stages, template):
    s = _serve(stages, template, queue_timeout=0.5)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return served.openai()


@pytest.fixture(scope="module")
def route(stages):
    with Route([w.address for w in stages]) as r:
        yield r


def _greedy_text(route, ids, max_tokens):
    g = route.complete(ids, max_tokens=max_tokens)
    return g.text, g


def _sessions(stages) -> list[int]:
    return [len(w.worker.pipeline.table) for w in stages]


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME]
    m = client.models.retrieve(NAME)
    assert m.id == NAME and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_penalties_and_logit_bias_are_the_routes_own(client, route):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (and llama-server's
    repeat_penalty and min_p, as extra fields) reach the last stage: the text is the route's
    own with the same sampling, and differs from the plain text."""
    from dgr.protocol.sampling import SamplingParams

    ids = route.tokenize(PROMPT, True, True)
    plain, g = _greedy_text(route, ids, 16)
    banned = g.tokens[0]
    r = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, presence_penalty=1.5,
        frequency_penalty=1.0, logit_bias={str(banned): -100},
        extra_body={"repeat_penalty": 1.3, "min_p": 0.05})
    sp = SamplingParams(presence_penalty=1.5, frequency_penalty=1.0, repeat_penalty=1.3,
                        min_p=0.05, penalty_last_n=64, logit_bias=((banned, -100.0),))
    want = route.complete(ids, max_tokens=16, sampling=sp)
    assert r.choices[0].text == want.text != plain and banned not in want.tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4,
                                  extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat"


def test_completion_equals_the_routes_greedy_text(client, route):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    ids = route.tokenize(PROMPT, True, True)
    text, g = _greedy_text(route, ids, 12)
    assert r.choices[0].text == text and text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(g.tokens)
    assert r.usage.total_tokens == len(ids) + len(g.tokens)
    assert r.choices[0].finish_reason == ("length" if g.stop_reason == "length" else "stop")


def test_chat_completion_equals_the_routes_greedy_text_of_the_template(client, route,
                                                                      template):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16,
                                       temperature=0)
    text, add_bos = template.render_prompt(MESSAGES, add_generation_prompt=True)
    ids = route.tokenize(text, add_bos, True)
    want, g = _greedy_text(route, ids, 16)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and want
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(g.tokens)


def test_streamed_chat_gives_the_same_text_and_usage_last(client):
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1


def test_streamed_completion_ends_with_done(served):
    conn = http.client.HTTPConnection(served.host, served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [ln for ln in resp.read().decode().split("\n\n") if ln]
    conn.close()
    assert events[-1] == "data: [DONE]"
    body = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(b["object"] == "text_completion" for b in body)
    assert body[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_sequence_cuts_the_text(client, route):
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    kw["seed"] = -3  # any int64, as OpenAI's API takes
    c, d = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert c == d and c


@pytest.mark.parametrize("kw, status, needle", [
    (dict(n=3), 400, "'n' is 3 but this route has 2 slot(s)"),
    (dict(model="gpt-4"), 404, "does not exist"),
    (dict(max_tokens=100000), 400, "maximum context length is 256 tokens"),
    (dict(temperature=5), 400, "temperature"),
    (dict(stop=[1, 2]), 400, "stop"),
    (dict(top_logprobs=3), 400, "needs 'logprobs': true"),
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
])
def test_errors_have_the_openai_shape_and_status(client, kw, status, needle):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body["error"] if "error" in e.value.body else e.value.body
    assert needle in err["message"] and set(err) >= {"message", "type", "param", "code"}


def _expected_logprobs(route, ids, max_tokens, k):
    """(token, logprob, top-k ids) of the route's greedy generation, from its own logits rows
    (parity mode), computed here with numpy's float64 log-softmax."""
    import numpy as np

    g = route.complete(ids, max_tokens=max_tokens, logits=True)
    out = []
    for tok, row in zip(g.tokens, g.logits):
        x = row.astype(np.float64)
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        out.append((tok, x[tok] - lse, list(np.argsort(-x, kind="stable")[:k])))
    return g, out


def test_chat_logprobs_are_the_log_softmax_of_the_routes_logits(client, route, template):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=3)
    text, add_bos = template.render_prompt(MESSAGES, add_generation_prompt=True)
    g, want = _expected_logprobs(route, route.tokenize(text, add_bos, True), 8, 3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(g.tokens) == len(want)
    for c, (tok, lp, top) in zip(content, want):
        assert c.token == route.detokenize([tok])
        assert c.logprob == pytest.approx(lp, abs=1e-9) and c.logprob <= 0
        assert c.bytes == list(c.token.encode())
        # greedy: the sampled token is the most likely one
        assert [t.token for t in c.top_logprobs] == [route.detokenize([int(t)]) for t in top]
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-12)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_streamed_logprobs_cover_every_token_once(client):
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        logprobs=True, top_logprobs=2))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == \
        [(c.token, c.logprob) for c in whole.choices[0].logprobs.content]


def test_completion_logprobs_shape(client, route):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=2)
    _, want = _expected_logprobs(route, route.tokenize(PROMPT, True, True), 6, 2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([w[1] for w in want], abs=1e-9)
    assert [len(t) for t in lp.top_logprobs] == [2] * len(want)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(want))]
    assert "".join(lp.tokens) == r.choices[0].text
    without = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6,
                                        temperature=0)
    assert without.choices[0].logprobs is None and without.choices[0].text == r.choices[0].text


def test_too_long_names_both_lengths(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=255)
    msg = e.value.body["message"] if "message" in e.value.body else e.value.body["error"][
        "message"]
    assert "256 tokens" in msg and "255 for the completion" in msg


def test_bad_json_and_unknown_paths(served):
    conn = http.client.HTTPConnection(served.host, served.port, timeout=30)
    for path, body, status in [("/v1/chat/completions", b"{not json", 400),
                               ("/v1/completions", b"[1, 2]", 400),
                               ("/v1/nothing", b"{}", 404),
                               ("/v1/completions", b" " * (9 << 20), 413)]:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        assert r.status == status and set(data["error"]) == {"message", "type", "param",
                                                             "code"}, (path, data)
    conn.close()


def test_health_and_metrics(served):
    conn = http.client.HTTPConnection(served.host, served.port, timeout=30)
    conn.request("GET", "/health")
    r = conn.getresponse()
    h = json.loads(r.read())
    assert r.status == 200 and h["status"] == "ok" and len(h["stages"]) == 2
    assert [s["layers"] for s in h["stages"]] == [[0, 15], [15, 30]]
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    assert r.status == 200 and "dgr_serve_requests_total" in text
    assert 'endpoint="chat",status="200"' in text
    conn.close()


def _open_stream(served, max_tokens=200):
    conn = http.client.HTTPConnection(served.host, served.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.8,
         "seed": 1, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event: a generation is running on its session
    return conn, resp


def _post_completion(served) -> tuple[int, str | None, dict]:
    conn = http.client.HTTPConnection(served.host, served.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": PROMPT, "max_tokens": 4}),
        {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read())
    conn.close()
    return r.status, r.getheader("Retry-After"), data


def test_every_slot_busy_queues_then_a_503_and_a_full_queue_is_429(served, stages, template):
    """Beyond the route's 2 slots a request waits in the queue: past its deadline (0.5 s
    here) a 503 with Retry-After; with no room in the queue a 429 with Retry-After at once."""
    held = [_open_stream(served) for _ in range(2)]  # the route has 2 slots
    try:
        status, retry, data = _post_completion(served)
        assert status == 503 and retry == "1", data
        assert data["error"]["code"] == "queue_timeout" and "busy" in data["error"]["message"]
    finally:
        for c, _ in held:
            c.close()
    wait_until(lambda: not any(_sessions(stages)), "the held streams' sessions gone", 10, 0.05)
    full = _serve(stages, template, queue_timeout=30, max_queue=0)
    held = [_open_stream(full) for _ in range(2)]
    try:
        t0 = time.monotonic()
        status, retry, data = _post_completion(full)
        assert time.monotonic() - t0 < 10  # at once, not after the queue's 30 s
        assert status == 429 and retry == "1", data
        assert data["error"]["type"] == "rate_limit_error"
        assert data["error"]["code"] == "queue_full"
    finally:
        for c, _ in held:
            c.close()
        full.stop()


def test_a_client_that_disconnects_mid_stream_releases_its_sessions(served, stages):
    wait_until(lambda: not any(_sessions(stages)), "earlier tests' sessions gone", 10, 0.05)
    conn, resp = _open_stream(served)
    assert _sessions(stages) == [1, 1]
    conn.close()  # mid-stream: 200 tokens asked, one event read
    t0 = time.monotonic()
    while any(_sessions(stages)) and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    released = time.monotonic() - t0
    assert _sessions(stages) == [0, 0]
    assert released < 1.0, f"sessions released {released:.2f} s after the disconnect"


def test_the_serve_command_starts_a_cluster_serves_it_and_stops_it(smollm2):
    """``python -m dgr serve``: local workers, the API on the port asked, Ctrl-C stops both."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "dgr", "serve", "--model", str(smollm2),
                          "--stages", "2", "--port", str(port), "--ctx", "256", "--slots", "1",
                          "--model-name", "tiny-route"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, p.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "dgr serve did not come up"
                time.sleep(0.2)
        assert len(health["stages"]) == 2 and health["status"] == "ok"
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                           max_retries=0) as c:
            assert [m.id for m in c.models.list().data] == ["tiny-route"]
            r = c.chat.completions.create(model="tiny-route", messages=MESSAGES, max_tokens=4,
                                          temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
    finally:
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    assert p.returncode in (0, 130), out
    assert "workers stopped (exit status 0, 0)" in out, out


def test_api_keys_with_the_openai_client(stages, template, route):
    """With API keys the official client works with a key and gets AuthenticationError
    (401) without one or with another; the health probe stays public."""
    keys = ["sk-dgr-test-key-0123456789"]
    s = _serve(stages, template, api_keys=keys)
    try:
        good = s.openai(api_key=keys[0])
        r = good.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
        ids = route.tokenize(PROMPT, True, True)
        assert r.choices[0].text == _greedy_text(route, ids, 4)[0]
        for key in ("sk-dgr-some-other-key-000", ""):
            bad = s.openai(api_key=key or "x")
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.status_code == 401 and keys[0] not in str(e.value)
        host, port = s.base.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        s.stop()


def _key_in_flight(s: Served, key: str, name: str) -> float:
    """``dgr_serve_key_requests_in_flight{key=name}`` from the front's /metrics."""
    conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"})
    text = conn.getresponse().read().decode()
    conn.close()
    line = next((ln for ln in text.splitlines()
                 if ln.startswith(f'dgr_serve_key_requests_in_flight{{key="{name}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_one_key_at_its_cap_cannot_take_another_keys_slot(stages, template, route):
    """Key A opens as many streamed generations as its cap allows (the default: half the
    route's 2 slots) and one more, which the official client sees as RateLimitError (429,
    ``Retry-After``); key B's greedy completion meanwhile equals the route's own greedy text.
    Closing A's streams gives its count back to 0, and A is served again."""
    from dgr.serve.app import per_key_default
    from dgr.serve.auth import ApiKey

    keys = [ApiKey("team-a", "sk-dgr-team-a-0123456789"),
            ApiKey("team-b", "sk-dgr-team-b-0123456789")]
    s = _serve(stages, template, api_keys=keys, queue_timeout=0.5)
    try:
        a, b = (s.openai(api_key=k.secret) for k in keys)
        cap = per_key_default(SETTINGS["n_slots"])
        held = []
        for _ in range(cap):
            stream = a.completions.create(model=NAME, prompt=PROMPT, max_tokens=200,
                                          temperature=0.8, seed=1, stream=True)
            next(iter(stream))  # its generation runs on a session
            held.append(stream)
        assert _key_in_flight(s, keys[0].secret, "team-a") == cap
        with pytest.raises(openai.RateLimitError) as e:
            a.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, stream=True)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        err = e.value.body["error"] if "error" in e.value.body else e.value.body
        assert err["code"] == "max_requests_per_key" and err["type"] == "rate_limit_error"
        r = b.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        for stream in held:
            stream.close()  # the client goes: the server cancels the generation
        wait_until(lambda: _key_in_flight(s, keys[0].secret, "team-a") == 0,
                   "the gone client's requests no longer count against its key", 10, 0.05)
        again = a.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0)
        assert again.usage.completion_tokens >= 1
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    while any(_sessions(stages)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ids = route.tokenize(PROMPT, True, True)
    assert r.choices[0].text == _greedy_text(route, ids, 12)[0] and r.choices[0].text


def test_a_speculating_front_gives_the_plain_routes_text_and_counts_its_drafts(
        stages, template, route):
    """``serve --speculate ngram``: the same greedy text as a route without speculation,
    and /metrics counts the decode trips and the drafts sent and accepted.

    The prompt repeats a pattern and the greedy text goes on repeating it (checked on the
    plain route first): every n-gram draft is then the pattern's continuation, whichever
    position a trip ends at, so every draft is accepted. A text that matches its own n-grams
    only by chance makes a few drafts, whether any is made and accepted depends on the exact
    tokens (the CPU's kernels) and on the positions the trips fall at."""
    from dgr.serve.app import create_app
    from dgr.worker.speculation import FixedDraftPolicy

    period = 4  # " a", " b", " c", " d": a token each
    prompt = " ".join(["a b c d"] * 4 + ["a b"])
    n = 24
    ids = route.tokenize(prompt, True, True)
    text, g = _greedy_text(route, ids, n)
    seq = [*ids, *g.tokens]
    assert len(g.tokens) == n and all(seq[i] == seq[i - period]
                                      for i in range(len(ids), len(seq))), \
        f"the greedy text does not go on with the prompt's pattern: {text!r}"
    # drafts from the tokens alone: the adaptive policy may judge them not to pay on loopback
    speculator = stages[-1].worker.pipeline.speculator
    policy, speculator.policy = speculator.policy, FixedDraftPolicy()
    app = create_app(AsyncRoute([w.address for w in stages], speculate="ngram"), model=NAME,
                     template=template)
    s = Served(app)
    try:
        r = s.openai().completions.create(model=NAME, prompt=prompt, max_tokens=n,
                                          temperature=0)
        assert r.choices[0].text == text and r.usage.completion_tokens == n
        conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
        conn.close()
        vals = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
                if line.startswith("dgr_serve_") and "_total " in line}
        trips = vals["dgr_serve_decode_trips_total"]
        drafted = vals["dgr_serve_speculative_drafts_total"]
        accepted = vals["dgr_serve_speculative_drafts_accepted_total"]
        assert 0 < drafted == accepted, (trips, drafted, accepted)
        assert trips + accepted == n - 1  # the first token is the prefill's
        # the status page's speculation panel: the same counts over its window
        conn = http.client.HTTPConnection(s.host, s.port, timeout=30)
        conn.request("GET", "/status")
        t = json.loads(conn.getresponse().read())["traffic"]
        conn.close()
        assert (t["drafted"], t["accepted"], t["acceptance"]) == (drafted, accepted, 1.0)
        assert t["tokens_per_trip"] == (trips + accepted) / trips
    finally:
        s.stop()
        speculator.policy = policy


_S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"city": _S}, "required": ["city"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["x"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
     "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False}}, "required": ["p"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"a": _S, "b": _S, "c": _S}, "required": ["a", "c"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"const": True}, "why": _S},
     "required": ["ok", "why"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "string", "maxLength": 20},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, _S]}},
     "required": ["v"]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}$"}},
     "required": ["when"]},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer"}}}}, "required": ["m"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                                      "label": {"enum": ["low", "high"]}},
     "required": ["level", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"name": _S, "nick": {"type": ["string", "null"],
                                                           "maxLength": 8}},
     "required": ["name", "nick"]},
    {"type": "object", "properties": {"scores": {"type": "object", "properties": {
        # bounded: an unbounded integer is a valid place for greedy SmolLM2 to write digits
        # until max_tokens (it does on an AVX2-only EPYC, whose kernels give other bits than
        # AVX-512's); the grammar holds the bounds and jsonschema checks them
        "math": {"type": "integer", "minimum": 0, "maximum": 100},
        "art": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["math", "art"], "additionalProperties": False}}, "required": ["scores"],
     "additionalProperties": False},
]


def _strict(schema):
    """As OpenAI's strict mode asks: every object closed (``additionalProperties: false``)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_json_schema_output_validates_for_twenty_schemas(client):
    """``response_format`` ``json_schema`` with ``strict``, through the official client: every
    reply parses and validates (nested objects, enums, arrays, required keys, patterns)."""
    jsonschema = pytest.importorskip("jsonschema")
    assert len(SCHEMAS) == 20
    for i, schema in enumerate(map(_strict, SCHEMAS)):
        r = client.chat.completions.create(
            model=NAME, max_tokens=120, temperature=0,
            messages=[{"role": "user", "content": "Answer with JSON about a small town."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema,
                                             "strict": True}})
        c = r.choices[0]
        assert c.finish_reason == "stop", (i, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)
    r = client.chat.completions.create(model=NAME, max_tokens=120, temperature=0,
                                       messages=MESSAGES,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
