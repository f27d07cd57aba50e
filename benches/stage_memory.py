"""Resident memory of each stage after load vs the whole model (each in its own process).

    python benches/stage_memory.py [--stages 3] [--json out.json]

mmap must not pull in the layers a stage does not own: RssFile of a middle stage should be
about its share of the file, not the whole file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys
import dgr
path, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rss():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out
before = rss()
e = dgr.Engine(path, layers=None if b < 0 else (a, b), n_ctx=1024, n_threads=1, n_ubatch=64)
d = e.describe()
after = rss()
# touch every owned weight: a 64-token prefill and 4 decode steps
import numpy as np
x = np.arange(64, dtype=np.int32) + 100
if e.is_first:
    y = e.forward(0, 0, x)
else:
    y = e.forward(0, 0, boundary=np.zeros((64, e.n_embd_boundary), np.float32))
for k in range(4):
    if e.is_first:
        e.forward(0, 64 + k, x[:1])
    else:
        e.forward(0, 64 + k, boundary=np.zeros((1, e.n_embd_boundary), np.float32))
used = rss()
print(json.dumps({"layers": d["layers"], "weight_bytes": d["weight_bytes"], "kv_bytes": d["kv_bytes"],
                  "rss_before": before, "rss_after": after, "rss_used": used}))
"""


def measure(path: str, a: int, b: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(a), str(b)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(path: str, n_stages: int) -> list[dict]:
    import dgr
    from dgr.protocol.ranges import split_layers

    n_layer = dgr.Engine(path, n_ctx=64).n_layer
    rows = [measure(path, 0, -1)]
    rows += [measure(path, a, b) for a, b in split_layers(n_layer, n_stages)]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from dgr.artifacts import models

    path = args.model or str(models.path())
    rows = run(path, args.stages)
    whole = rows[0]
    mib = 1 / 2**20
    print(f"{'layers':>10} {'weights MiB':>12} {'KV MiB':>8} {'RSS load':>9} {'RSS used':>9} "
          f"{'RssFile used':>13} {'used/whole':>11}")
    base = whole["rss_before"]["VmRSS"]
    w_used = whole["rss_used"]["VmRSS"] - base
    for r in rows:
        b0 = r["rss_before"]
        load = r["rss_after"]["VmRSS"] - b0["VmRSS"]
        used = r["rss_used"]["VmRSS"] - b0["VmRSS"]
        fil = r["rss_used"]["RssFile"] - b0["RssFile"]
        print(f"{str(r['layers']):>10} {r['weight_bytes'] * mib:>12.1f} {r['kv_bytes'] * mib:>8.1f} "
              f"{load * mib:>9.1f} {used * mib:>9.1f} {fil * mib:>13.1f} {used / w_used:>11.2f}")
    print("RSS deltas are measured from just before the engine loads; 'used' is after a 64-token "
          "prefill and 4 decode steps (every owned weight touched).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
