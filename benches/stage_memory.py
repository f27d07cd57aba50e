"""Resident memory of each stage after load vs the whole model (each in its own process).

    python benches/stage_memory.py [--stages 3] [--json out.json]

mmap must not pull in the layers a stage does not own: RssFile of a middle stage should be
about its share of the file, not the whole file. A recurrent or hybrid model's stage also
reports its state bytes per session (its own layers' conv/SSM rows, inside the KV figure) and
the host bytes of the state snapshots it holds after the 64-token prefill (one, at 64).
"""

from __future__ import annotations

import sys

from harness import cli, fresh
def _rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def stage_rss(path: str, a: int, b: int) -> dict:
    """In this process: RSS before and after loading layers [a, b) (b < 0: the whole model),
    and after a 64-token prefill and 4 decode steps (every owned weight touched)."""
    import numpy as np

    import dgr

    before = _rss()
    e = dgr.Engine(path, layers=None if b < 0 else (a, b), n_ctx=1024, n_threads=1,
                   n_ubatch=64)
    d = e.describe()
    after = _rss()
    x = (np.arange(64, dtype=np.int32) + 100) % e.n_vocab
    if e.is_first:
        e.forward(0, 0, x)
    else:
        e.forward(0, 0, boundary=np.zeros((64, e.n_embd_boundary), np.float32))
    for k in range(4):
        if e.is_first:
            e.forward(0, 64 + k, x[:1])
        else:
            e.forward(0, 64 + k, boundary=np.zeros((1, e.n_embd_boundary), np.float32))
    used = _rss()
    return {"layers": d["layers"], "weight_bytes": d["weight_bytes"],
            "kv_bytes": d["kv_bytes"], "state_bytes": d.get("state_bytes", 0),
            "state_snapshot_bytes": e.describe().get("state_snapshot_bytes", 0),
            "rss_before": before, "rss_after": after, "rss_used": used}


def measure(path: str, a: int, b: int) -> dict:
    """``stage_rss`` in a process of its own."""
    return fresh.call("stage_memory", "stage_rss", path, a, b)


def run(path: str, n_stages: int) -> list[dict]:
    import dgr
    from dgr.protocol.ranges import split_layers

    n_layer = dgr.Engine(path, n_ctx=64).n_layer
    rows = [measure(path, 0, -1)]
    rows += [measure(path, a, b) for a, b in split_layers(n_layer, n_stages)]
    return rows


def main() -> int:
    ap = cli.parser(__doc__, stages=3, json=True)
    ap.add_argument("--model")
    args = ap.parse_args()
    from dgr.artifacts import models

    path = args.model or str(models.path())
    rows = run(path, args.stages)
    whole = rows[0]
    mib = 1 / 2**20
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}; model {path}")
    print(f"{'layers':>10} {'weights MiB':>12} {'KV MiB':>8} {'state KiB':>10} {'snaps KiB':>10} "
          f"{'RSS load':>9} {'RSS used':>9} {'RssFile used':>13} {'used/whole':>11}")
    base = whole["rss_before"]["VmRSS"]
    w_used = whole["rss_used"]["VmRSS"] - base
    for r in rows:
        b0 = r["rss_before"]
        load = r["rss_after"]["VmRSS"] - b0["VmRSS"]
        used = r["rss_used"]["VmRSS"] - b0["VmRSS"]
        fil = r["rss_used"]["RssFile"] - b0["RssFile"]
        print(f"{str(r['layers']):>10} {r['weight_bytes'] * mib:>12.1f} {r['kv_bytes'] * mib:>8.1f} "
              f"{r['state_bytes'] / 1024:>10.1f} {r['state_snapshot_bytes'] / 1024:>10.1f} "
              f"{load * mib:>9.1f} {used * mib:>9.1f} {fil * mib:>13.1f} {used / w_used:>11.2f}")
    print("RSS deltas are measured from just before the engine loads; 'used' is after a 64-token "
          "prefill and 4 decode steps (every owned weight touched); state: bytes per session "
          "(in KV too), snaps: the state snapshots held then.")
    cli.write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
