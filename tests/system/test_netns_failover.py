"""Workers as separate hosts (network namespaces on a bridge): a host cut off mid-generation.

Needs root and iproute2 (CI runs as root and installs iproute2); skipped elsewhere.
The route driver runs on a host of its own; the middle worker's link goes down mid-generation:
no error reaches the driver, its sized deadline fires, the spare on another host takes over
and the tokens are those of an uninterrupted run. Token by token the cut comes after ten
tokens; with the decode loop (which runs ahead of the reader, and may even finish) right
after the prefill's token, before the loop's first step; with so few steps measured the
deadline is the route's step_timeout (5 s here).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time

import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.testing.netns import Netns, NetnsWorker, available

OK, WHY = available()
pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not OK, reason=f"needs network namespaces: {WHY}"),
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="multi-stage routes need the "
                                 "llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")]

SETTINGS = dict(n_ctx=160, n_slots=4, n_threads=1, n_ubatch=32, flash_attn=True)
PROMPT = [5, 17, 99, 3, 42, 8, 77, 11, 64, 2, 31, 120]
N_TOKENS = 64

# runs on host 0: generate k tokens, say READY, wait for a line, finish, print the outcome
DRIVER = r"""
import json, sys
from dgr.driver import Route
eps, spares, prompt, n, loop, k = json.loads(sys.argv[1])
# step_timeout: a route that has measured fewer than 8 steps (the decode loop's case here:
# only the prefill) waits that long before it gives a silent host up
with Route(eps, spares=spares, deadline_floor=0.5, connect_timeout=15, probe_timeout=0.5,
           loop=loop, step_timeout=5) as r:
    s = r.session()
    it = s.generate(prompt, max_tokens=n, stop_on_eog=False)
    toks = [next(it) for _ in range(k)]
    print("READY", flush=True)
    sys.stdin.readline()
    toks += list(it)
    print(json.dumps(dict(tokens=toks, recoveries=s.recoveries,
                          replacements=r.aroute.replacements)), flush=True)
    s.close()
"""


def first_line(proc: subprocess.Popen, timeout: float) -> tuple[bytes, bytes, bytes]:
    """``proc``'s first line of stdout within ``timeout`` seconds, draining its stderr
    meanwhile (a full pipe would stall it): (line, stdout after the line, stderr so far).
    Fails the test, with the child's stderr, when no line comes: a silent child is a failure
    here, not a hang."""
    out, err = b"", b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "out")
        sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "err")
        while b"\n" not in out and proc.stdout.fileno() in sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                elif key.data == "out":
                    out += chunk
                else:
                    err += chunk
    if b"\n" not in out:
        pytest.fail(f"no line on stdout within {timeout:g} s (stdout {out!r}); stderr:\n"
                    + err.decode(errors="replace"))
    line, _, rest = out.partition(b"\n")
    return line, rest, err


@pytest.mark.parametrize("loop", [False, True], ids=["token-by-token", "decode-loop"])
def test_host_cut_off_mid_generation_completes_on_a_spare_host(tiny_llama, loop):
    whole = dgr.Engine(tiny_llama, **{**SETTINGS, "n_slots": 1})
    ref = generate_local(whole, PROMPT, max_tokens=N_TOKENS, stop_on_eog=False)[0]
    with Netns(5) as net:  # host 0: driver; 1, 2, 4: the route; 3: spare of [1, 3)
        plan = {1: (0, 1), 2: (1, 3), 3: (1, 3), 4: (3, 4)}
        workers = {i: NetnsWorker(net, i, str(tiny_llama), lr, settings=SETTINGS)
                   for i, lr in plan.items()}
        driver = None
        try:
            for w in workers.values():
                w.start()
            eps = {i: w.wait_listening(60) for i, w in workers.items()}
            assert eps[2].startswith("10.213.0.4:")
            arg = json.dumps([[eps[1], eps[2], eps[4]], [eps[3]], PROMPT, N_TOKENS, loop,
                              1 if loop else 10])
            driver = subprocess.Popen(net.exec_args(0) + [sys.executable, "-c", DRIVER, arg],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
            # a hang guard: ten tokens of the tiny model after the route's connect
            line, out, err = first_line(driver, 120)
            assert line.strip() == b"READY", (line, err.decode(errors="replace"))
            net.cut(2)  # the middle worker's host drops off the network
            driver.stdin.write(b"go\n")
            driver.stdin.flush()
            more_out, more_err = driver.communicate(timeout=60)
            out, err = out + more_out, (err + more_err).decode(errors="replace")
            assert driver.returncode == 0, err
            got = json.loads(out)
        finally:
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.wait()
            for w in workers.values():
                w.kill()
    assert got["tokens"] == ref
    assert got["recoveries"] == 1
    assert got["replacements"] == [[[1, 3], eps[2], eps[3]]]
