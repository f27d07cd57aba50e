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
SEEN: list[str] = []  # the user messages the stub was sent


class _Stub(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append(body["messages"][-1]["content"])
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


def test_no_request_repeats_a_message_of_another_round(stub):
    """A repeated prompt is a prompt-cache hit on either server: rounds must not measure it."""
    SEEN.clear()
    for rd in range(2):
        serve_load.run_load(stub, "m", k=2, n_requests=2, max_tokens=1, tag=f"{rd}-")
    assert len(SEEN) == 8 and len(set(SEEN)) == 8


def test_cpu_per_token_counts_each_process_while_the_load_runs():
    import os
    import subprocess
    import sys

    from harness.measure import children

    # a child that burns about 0.3 s of CPU once told to, then waits
    code = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
            "sys.stdin.readline()\n")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as p:  # exits at stdin's EOF
        assert p.pid in children(os.getpid())

        def load():
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            return {"output_tokens": 10}

        row = serve_load.cpu_per_token([p.pid], load)
        (per,) = row["cpu_ms_per_token_by_process"]
        assert 25 <= per < 100 and row["cpu_ms_per_token"] == per  # 300 ms over 10 tokens
        assert serve_load._cpu_text(row) == f"{per:.1f}"
        two = {**row, "cpu_ms_per_token": 3.0, "cpu_ms_per_token_by_process": [1.0, 2.0]}
        assert serve_load._cpu_text(two) == "3.0 (1.0 + 2.0)"


def _row(server, rd, k, tok, ttft):
    return {"server": server, "round": rd, "clients": k, "output_tokens_per_s": tok,
            "ttft_ms_p50": ttft}


def test_the_summary_pairs_the_servers_round_by_round_and_takes_medians():
    rows = [_row("dgr", 0, 1, 90.0, 30.0), _row("llama-server", 0, 1, 100.0, 20.0),
            _row("llama-server", 0, 16, 200.0, 50.0), _row("dgr", 0, 16, 300.0, 60.0),
            _row("llama-server", 1, 1, 120.0, 30.0), _row("dgr", 1, 1, 96.0, 30.0),
            _row("llama-server", 1, 16, 200.0, 40.0), _row("dgr", 1, 16, 220.0, None),
            _row("dgr", 2, 1, 85.0, 40.0), _row("llama-server", 2, 1, 100.0, 20.0)]
    one, sixteen = serve_load.summarize(rows)
    assert one["clients"] == 1 and one["rounds"] == 3
    # ratios pair each round's rows, not the medians of each side
    assert one["ratio_tokens_per_s"] == pytest.approx([0.9, 0.8, 0.85])
    assert one["ratio_tokens_per_s_median"] == pytest.approx(0.85)
    assert one["ratio_ttft_p50"] == pytest.approx([1.5, 1.0, 2.0])
    assert one["dgr"] == {"output_tokens_per_s": 90.0, "ttft_ms_p50": 30.0}
    assert one["llama-server"] == {"output_tokens_per_s": 100.0, "ttft_ms_p50": 20.0}
    # a round with no TTFT on one side drops out of that ratio only
    assert sixteen["ratio_tokens_per_s"] == pytest.approx([1.5, 1.1])
    assert sixteen["ratio_ttft_p50"] == pytest.approx([1.2])
    assert sixteen["dgr"]["ttft_ms_p50"] == 60.0
    table = serve_load._summary_table([one, sixteen])
    assert "| 1 | 3 | 90.0 | 100.0 | 0.85 (0.90, 0.80, 0.85) | 1.50 (1.50, 1.00, 2.00) |" in table


def test_a_round_with_only_one_server_gives_no_ratio():
    (s,) = serve_load.summarize([_row("dgr", 0, 4, 50.0, 10.0)])
    assert s["rounds"] == 0 and s["ratio_tokens_per_s_median"] is None
    assert s["llama-server"] == {"output_tokens_per_s": None, "ttft_ms_p50": None}
    assert "| 4 | 0 | 50.0 | - | - () | - () |" in serve_load._summary_table([s])
