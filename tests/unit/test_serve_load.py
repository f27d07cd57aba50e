"""benches/serve_load.py's client against a stub server of server-sent events: what it
measures per request (TTFT, time per output token, output tokens from usage) and per batch."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

serve_load = pytest.importorskip("serve_load")

GAP = 0.05  # seconds between the stub's content events


class _Stub(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(2 * GAP)  # the prefill
        ev = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        for i in range(n):
            ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(GAP)
        ev = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                       "total_tokens": 5 + n}}
        self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\ndata: [DONE]\n\n")


@pytest.fixture(scope="module")
def stub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    t.join(5)


def test_one_request_measures_ttft_tpot_and_tokens(stub):
    r = serve_load.one_request(stub, "m", "hi", 5)
    assert r["tokens"] == 5
    assert 2 * GAP * 0.8 <= r["ttft_s"] < 2 * GAP + 1.0  # the role-only event is not content
    assert GAP * 0.8 <= r["tpot_s"] < GAP + 0.5


def test_run_load_aggregates_over_the_batch(stub):
    row = serve_load.run_load(stub, "m", k=3, n_requests=2, max_tokens=4)
    assert (row["clients"], row["requests"], row["failed"]) == (3, 6, 0)
    assert row["output_tokens"] == 24
    assert row["output_tokens_per_s"] == pytest.approx(24 / row["wall_s"])
    assert row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["tpot_ms_p50"] <= row["tpot_ms_p99"]
