"""``python -m dgr serve`` on the default model with no flag, as a new user starts it: its
context is the model's trained one (``--ctx 0``), so an agent's 7,000-token first request is
served through the official ``anthropic`` client; and 32 concurrent streams of the official
``openai`` client all complete on its 4 slots, queued in order, none refused or lost."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.system]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """The default server: ``dgr serve --model M --port P``, nothing else; yields (base URL,
    the model card, the file of what it prints)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    f = open(log, "w")
    p = subprocess.Popen([sys.executable, "-m", "dgr", "serve", "--model", str(smollm2),
                          "--port", str(port)], stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert p.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    card = json.loads(r.read())["data"][0]
                break
            except OSError:
                assert time.monotonic() < deadline, "dgr serve did not come up"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", card, log
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=120)
        finally:
            f.close()
    assert p.returncode in (0, 130), log.read_text()
    assert "workers stopped (exit status 0, 0, 0)" in log.read_text()


def test_the_route_holds_the_models_trained_context_and_says_so(server):
    _, card, _ = server
    # SmolLM2 was trained for 8192 tokens: every stage holds them for each of its 4 slots (a
    # third of the layers each), and the front says so
    assert card["max_model_len"] == card["meta"]["n_ctx"] == 8192
    assert card["meta"]["n_ctx_train"] == 8192


def test_an_agents_7000_token_first_request_is_served(server):
    url, card, _ = server
    files = "\n".join(f"def handler_{i}(request):\n    return respond(request, code={i})\n"
                      for i in range(315))
    with anthropic.Anthropic(base_url=url, api_key="-", max_retries=0, timeout=600) as c:
        r = c.messages.create(
            model=card["id"], max_tokens=4,
            system="You are a coding agent. Answer with the file's last function name.",
            messages=[{"role": "user", "content": files}])
    assert 7000 <= r.usage.input_tokens <= 8192 - 4, r.usage
    assert r.stop_reason in ("max_tokens", "end_turn") and r.content


def test_32_concurrent_streams_all_complete_on_4_slots(server):
    url, card, _ = server

    async def go():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                                      timeout=600) as c:
            async def one(i):
                stream = await c.completions.create(
                    model=card["id"], prompt=f"Sub-agent {i}: list three colours:",
                    max_tokens=6, temperature=0, stream=True)
                text, finish = "", None
                async for ev in stream:
                    if ev.choices:
                        text += ev.choices[0].text
                        finish = ev.choices[0].finish_reason or finish
                return text, finish

            return await asyncio.gather(*(one(i) for i in range(32)))

    got = asyncio.run(go())
    assert len(got) == 32 and all(finish in ("length", "stop") for _, finish in got), got
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    waits = [float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("dgr_serve_queue_wait_seconds_count")]
    assert waits and waits[0] >= 32  # every request went through the queue's count
    assert "dgr_serve_queue_refused_total 0.0" in metrics
    assert "dgr_serve_queue_timeouts_total 0.0" in metrics


def test_the_server_said_at_start_the_context_it_chose(server):
    *_, log = server
    text = log.read_text()
    assert "context: 8192 tokens per session (the least of the 3 stage(s)'" in text, text
    assert "the model's trained context (n_ctx_train 8192)" in text, text
