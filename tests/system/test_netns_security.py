"""A route across hosts (network namespaces on a bridge) with credentials and mutual TLS.

Needs root and iproute2 (CI runs as root and installs iproute2); skipped elsewhere.
Three workers on three hosts serve with ``--cluster-keys`` and ``--tls-client-auth``; a
driver on a fourth host, configured only through the environment (``DGR_CLUSTER_KEY_FILE``,
``DGR_TLS_*``, as docs/security.md says), gets the tokens of the whole model over both
planes. From the same host, a stranger without the credential, one with the credential but
no client certificate, and a plaintext client are all refused, and the route still serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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

SETTINGS = dict(n_ctx=128, n_slots=2, n_threads=1, n_ubatch=16)
PROMPT = [5, 17, 99, 3, 42, 8, 77, 11, 64, 2, 31, 120]

# runs on host 0: the route (both paths), then what a stranger gets, as JSON
DRIVER = r"""
import asyncio, json, os, sys
from dgr import errors
from dgr.driver import Route
from dgr.transport.client import ShardClient
from dgr.transport.security import Security, TLSConfig
eps, prompt = json.loads(sys.argv[1])
out = {}
for relay in (True, False):
    with Route(eps, relay=relay, connect_timeout=15) as r:
        out[f"relay={relay}"] = r.complete(prompt, max_tokens=16, stop_on_eog=False).tokens
        out[f"relay_steps={relay}"] = r.aroute.relay_steps
ca = os.environ["DGR_TLS_CA"]
creds = Security.from_env().credential
async def stranger(sec):
    c = ShardClient(eps[0], timeout=5, security=sec)
    try:
        await c.describe()
        return "served"
    except errors.DgrError as e:
        return type(e).__name__
    finally:
        await c.close()
cases = {"no credential": Security(None, None, Security.from_env().tls),
         "no client certificate": Security(creds, None, TLSConfig(ca=ca)),
         "plaintext": Security(creds)}
out["strangers"] = {k: asyncio.run(stranger(v)) for k, v in cases.items()}
with Route(eps, connect_timeout=15) as r:
    out["after"] = r.complete(prompt, max_tokens=16, stop_on_eog=False).tokens
print(json.dumps(out), flush=True)
"""


def test_a_route_across_hosts_with_credentials_and_mutual_tls(tiny_llama, tmp_path):
    trustme = pytest.importorskip("trustme")
    ref = generate_local(dgr.Engine(tiny_llama, **{**SETTINGS, "n_slots": 1}), PROMPT,
                         max_tokens=16, stop_on_eog=False)[0]
    with Netns(4, subnet=7) as net:  # host 0: the driver; 1-3: the route
        ca = trustme.CA()
        # one certificate for the workers (server and client), one for the driver
        node = ca.issue_cert(*[h.address for h in net.hosts[1:]])
        driver_cert = ca.issue_cert("driver.example")
        files = {"ca": ca.cert_pem, "node": node.cert_chain_pems[0],
                 "node_key": node.private_key_pem, "drv": driver_cert.cert_chain_pems[0],
                 "drv_key": driver_cert.private_key_pem}
        for name, blob in files.items():
            blob.write_to_path(str(tmp_path / f"{name}.pem"))
        p = {k: str(tmp_path / f"{k}.pem") for k in files}
        (tmp_path / "cluster.keys").write_text(
            "workers 5f0c4e8a9b7d6c3e2f1a0b9c peer\n"
            "tenant  a1b2c3d4e5f60718293a4b5c sessions=2\n")
        (tmp_path / "tenant.keys").write_text("tenant  a1b2c3d4e5f60718293a4b5c\n")
        for k in ("cluster.keys", "tenant.keys"):
            (tmp_path / k).chmod(0o600)
        sec = ["--cluster-keys", str(tmp_path / "cluster.keys"), "--tls-cert", p["node"],
               "--tls-key", p["node_key"], "--tls-ca", p["ca"], "--tls-client-auth"]
        workers = [NetnsWorker(net, i, str(tiny_llama), lr, settings=SETTINGS, args=sec)
                   for i, lr in ((1, (0, 1)), (2, (1, 3)), (3, (3, 4)))]
        try:
            for w in workers:
                w.start()
            eps = [w.wait_listening(60) for w in workers]
            assert all("--insecure" not in w.command() for w in workers)
            env = {**os.environ, "DGR_CLUSTER_KEY_FILE": str(tmp_path / "tenant.keys"),
                   "DGR_TLS_CA": p["ca"], "DGR_TLS_CERT": p["drv"], "DGR_TLS_KEY": p["drv_key"]}
            r = subprocess.run(net.exec_args(0) + [sys.executable, "-c", DRIVER,
                                                   json.dumps([eps, PROMPT])],
                               capture_output=True, text=True, timeout=180, env=env)
            assert r.returncode == 0, r.stderr[-3000:]
            got = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            for w in workers:
                w.kill()
    assert got["relay=True"] == ref and got["relay_steps=True"] > 0
    assert got["relay=False"] == ref and got["relay_steps=False"] == 0
    assert got["strangers"] == {"no credential": "Unauthenticated",
                                "no client certificate": "WorkerUnavailable",
                                "plaintext": "WorkerUnavailable"}
    assert got["after"] == ref
