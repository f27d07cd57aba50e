"""Each layer's cost measured on this machine, and the stage ranges that balance it.

A route runs at its slowest stage's speed, so its ranges should give every stage the same
time per step. The weights multiplied per token (``dgr.artifacts.manifest.layer_costs``) are
a model of that time, and a CPU's caches, kernels and attention over the context make it
wrong by tens of percent. ``measure`` times it instead, on the stage's own device with the
stage's settings, at the batch (rows per forward) and the context the route will run:

- an engine of each single layer ``[i, i+1)``, with the stage's settings (its context and
  slots too: they size its KV cache): a prompt of ``context`` tokens in each of ``batch``
  slots, then decode steps of the ``batch`` slots in one forward, the fastest of ``steps`` of
  them (``warmup`` before, untimed). Layer 0's engine takes token ids (it holds
  the embedding), the last layer's returns logits (it holds the head), the others take and
  return boundary rows, as their stages do;
- each engine ``repeats`` times, afresh, the fastest taken: on the VMs measured, one instance
  of an identical engine ran 1.6x slower than the next for its whole life (llama.cpp's own
  programs too: docs/performance.md), and a stage in a route is one instance;
- an engine of ``k`` consecutive layers in the middle, timed the same way: what ``k`` layers
  cost in one forward against the sum of their single-layer times says what a forward costs
  whatever its layers (graph, scheduling, the boundary's copies), ``overhead_ms``; each
  layer's own cost is its time less that.

A stage of layers ``[a, b)`` then costs ``sum(layer_ms[a:b]) + overhead_ms`` per step
(:meth:`LayerCosts.stage_ms`), and :func:`plan` balances it with
``dgr.protocol.ranges.balance_stages`` (each stage its own machine's figures, when a route
spans machines). A measurement is cached per machine under ``$DGR_CACHE/layer-costs/``, keyed
by the model file, the build, the CPU, the device and the settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dgr import errors

__all__ = ["LayerCosts", "measure", "plan", "cache_path", "cached", "route_ranges", "ranges_of"]

#: the engine settings a measurement takes from a stage's: every one that may change a
#: forward's time (the context and the slots too: they size the KV cache)
SETTING_KEYS = ("n_ctx", "n_slots", "n_threads", "n_ubatch", "flash_attn", "type_k", "type_v",
                "batch_invariant", "device", "kv_budget_mib")


@dataclass
class LayerCosts:
    """One machine's measured cost of each layer of one model, per forward (a decode step of
    ``batch`` rows after ``context`` tokens), in milliseconds."""

    model: str
    n_layer: int
    batch: int
    context: int
    #: layer ``i``'s own time per forward (layer 0's with the embedding, the last's with the
    #: output head)
    layer_ms: list[float]
    #: what one forward costs whatever its layers
    overhead_ms: float
    #: each single-layer engine's whole time per forward, as measured
    single_ms: list[float]
    #: the ``k``-layer engine's: its range and time per forward
    chunk: tuple[int, int]
    chunk_ms: float
    settings: dict[str, Any]
    machine: dict[str, Any]
    seconds: float
    cached: bool = field(default=False, compare=False)

    def stage_ms(self, a: int, b: int) -> float:
        """What a stage of layers ``[a, b)`` costs per forward on this machine."""
        return sum(self.layer_ms[a:b]) + self.overhead_ms

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("cached")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LayerCosts":
        d = dict(d)
        d["chunk"] = tuple(d["chunk"])
        return cls(**d)


def _machine(device: str) -> dict[str, Any]:
    from dgr.core import BUILD_INFO, devices
    from dgr.vendor.cpu import cpu_features

    model, _, isa = cpu_features()
    dev = next((d for d in devices() if d["name"].lower() == device.lower()
                or (device == "cpu" and d["type"] == "cpu")), {})
    return {"cpu": model, "isa": " ".join(isa), "cores": os.cpu_count(),
            "device": device, "device_description": dev.get("description", ""),
            "llama_cpp": BUILD_INFO.get("llama_cpp_commit", ""),
            "build": BUILD_INFO.get("vendor_key", ""),
            "cpu_variant": BUILD_INFO.get("cpu_variant", "native")}


def key_settings(settings: dict) -> dict:
    """The settings a measurement is keyed by: :data:`SETTING_KEYS`, given ones only, the
    device ``cpu`` when not given, a KV budget only where one is set (it sizes ``n_ctx=0``)."""
    s = {k: settings[k] for k in SETTING_KEYS if settings.get(k) is not None}
    if not s.get("kv_budget_mib"):
        s.pop("kv_budget_mib", None)
    s.setdefault("device", "cpu")
    return s


def cache_path(model: str | os.PathLike, batch: int, context: int, settings: dict) -> Path:
    """Where a measurement of this model, batch, context and settings on this machine is
    kept: the key holds the file (path, size, modification time), the build, the CPU and
    the device."""
    from dgr.vendor import cache_root

    st = os.stat(model)
    s = key_settings(settings)
    key = json.dumps({"model": os.path.realpath(model), "size": st.st_size,
                      "mtime_ns": st.st_mtime_ns, "batch": batch, "context": context,
                      "settings": s, "machine": _machine(s["device"])},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "layer-costs" / f"{Path(model).stem}-b{batch}-c{context}-{digest}.json"


def _time_range(model: str, a: int, b: int, batch: int, context: int, steps: int, warmup: int,
                settings: dict) -> float:
    """The fastest of ``steps`` decode forwards of ``batch`` slots through an engine of
    ``[a, b)``, ms (the least disturbed by the rest of the machine: on a shared VM the median
    moved by a third from one minute to the next, the fastest by a few percent)."""
    from dgr.core.engine import Engine

    kw = {k: v for k, v in settings.items() if k in SETTING_KEYS}
    kw.setdefault("n_ctx", context + warmup + steps + 1)
    kw.setdefault("n_slots", batch)
    e = Engine(model, (a, b), **kw)
    if e.n_slots < batch or e.n_ctx < context + warmup + steps:
        raise errors.InvalidArgument(
            f"timing {batch} rows after {context} tokens (and {warmup + steps} steps) needs "
            f"{batch} slots of {context + warmup + steps} tokens; the settings give "
            f"{e.n_slots} of {e.n_ctx}")
    gen = np.random.default_rng(a)
    w = e.n_embd_boundary

    def inputs(n: int):  # a first stage's token ids, a later one's boundary rows
        return ((np.full(n, 1, np.int32), None) if e.is_first else
                (None, gen.standard_normal((n, w)).astype(np.float32)))

    for s in range(batch):  # each slot's prompt
        e.forward_batch(np.full(context, s, np.int32), np.arange(context, dtype=np.int32),
                        *inputs(context))
    slots, times = np.arange(batch, dtype=np.int32), []
    for r in range(warmup + steps):
        pos, (tok, bnd) = np.full(batch, context + r, np.int32), inputs(batch)
        t0 = time.perf_counter()
        e.forward_batch(slots, pos, tok, bnd)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times[warmup:])


def measure(model: str | os.PathLike, *, batch: int = 1, context: int = 64,
            settings: dict | None = None, steps: int = 16, warmup: int = 4, chunk: int = 8,
            repeats: int = 3, use_cache: bool = True, progress: bool = True) -> LayerCosts:
    """Time each layer of ``model`` on this machine (see the module docstring); a cached
    measurement of the same inputs is returned as it is (``cached`` True)."""
    from dgr.artifacts.manifest import layer_costs

    model = os.fspath(model)
    settings = {k: v for k, v in (settings or {}).items() if k in SETTING_KEYS}
    if batch < 1 or context < 1 or steps < 1 or repeats < 1:
        raise ValueError("batch, context, steps and repeats must be positive")

    def timed(a: int, b: int) -> float:  # the fastest of ``repeats`` engines of [a, b)
        return min(_time_range(model, a, b, batch, context, steps, warmup, settings)
                   for _ in range(repeats))

    path = cache_path(model, batch, context, settings)
    if use_cache and path.exists():
        try:
            got = LayerCosts.from_json(json.loads(path.read_text()))
            got.cached = True
            return got
        except (OSError, ValueError, TypeError, KeyError):
            pass  # unreadable: measure again
    t_start = time.monotonic()
    n = len(layer_costs(model)[0])  # the trunk's layers, from the headers
    single = []
    for i in range(n):
        single.append(timed(i, i + 1))
        if progress:
            print(f"\r[dgr] timing layer {i + 1}/{n} at batch {batch}: {single[-1]:.3f} ms",
                  end="", file=sys.stderr, flush=True)
    k = min(chunk, n)
    a = max(0, (n - k) // 2)
    if k >= 2:
        chunk_ms = timed(a, a + k)
        overhead = max(0.0, (sum(single[a:a + k]) - chunk_ms) / (k - 1))
    else:
        chunk_ms, overhead = single[0], 0.0
    # no layer costs less than nothing (noise on a layer as fast as the overhead)
    layer_ms = [max(t - overhead, 0.01 * t) for t in single]
    got = LayerCosts(model=model, n_layer=n, batch=batch, context=context, layer_ms=layer_ms,
                     overhead_ms=overhead, single_ms=single, chunk=(a, a + k),
                     chunk_ms=chunk_ms, settings=settings,
                     machine=_machine(settings.get("device") or "cpu"),
                     seconds=time.monotonic() - t_start)
    if progress:
        print(f"\r[dgr] timed {n} layers at batch {batch} in {got.seconds:.1f} s: a forward's "
              f"fixed cost {overhead:.3f} ms, layers {min(layer_ms):.3f}-{max(layer_ms):.3f} "
              f"ms", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may measure too
    tmp.write_text(json.dumps(got.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    return got


def plan(costs: Sequence[LayerCosts]) -> list[tuple[int, int]]:
    """The ranges whose slowest stage is fastest: one ``LayerCosts`` per stage, each its own
    machine's (the same one repeated for stages on alike machines)."""
    from dgr.protocol.ranges import balance_stages

    if not costs:
        raise ValueError("plan needs one measurement per stage")
    if len({c.n_layer for c in costs}) != 1:
        raise ValueError("the stages' measurements are of different models")
    return balance_stages([c.layer_ms for c in costs], [c.overhead_ms for c in costs])


def cached(model: str | os.PathLike, settings: dict | None = None) -> list[LayerCosts]:
    """Every measurement of ``model`` (this file, as it is now) made on this machine with
    these settings and this build, by batch: what the capability record advertises."""
    from dgr.vendor import cache_root

    model = os.fspath(model)
    try:
        st = os.stat(model)
    except OSError:
        return []
    s = {k: v for k, v in (settings or {}).items() if k in SETTING_KEYS}
    out = []
    for f in sorted((cache_root() / "layer-costs").glob(f"{Path(model).stem}-b*-c*-*.json")):
        try:
            c = LayerCosts.from_json(json.loads(f.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        # the file the key was made of: the same path, size and modification time
        if st.st_size and f == cache_path(model, c.batch, c.context, s):
            c.cached = True
            out.append(c)
    return sorted(out, key=lambda c: (c.batch, c.context))


def route_ranges(model: str | os.PathLike, n_stages: int, settings: dict, *, batch: int = 1,
                 context: int = 64, progress: bool = True) -> list[tuple[int, int]]:
    """``--splits cost``: ``n_stages`` ranges of ``model`` balanced by this machine's
    measured layer costs (measured once, then cached), for a route of stages alike."""
    c = measure(model, batch=batch, context=context, settings=settings, progress=progress)
    return plan([c] * n_stages)


def ranges_of(splits: str | None, stages: int, n_layer: int, model: str | os.PathLike,
              settings: dict, *, batch: int = 1) -> list[tuple[int, int]]:
    """The ranges a command line's ``--splits``/``--stages`` ask for: ``cost`` balances
    ``stages`` stages by this machine's measured layer costs at ``batch`` rows, anything else
    is ``dgr.protocol.ranges.ranges_for``'s (split points, or even ranges)."""
    from dgr.protocol.ranges import ranges_for

    if (splits or "").strip().lower() == "cost":
        if stages == 1:
            return [(0, n_layer)]
        return route_ranges(model, stages, settings, batch=batch)
    return ranges_for(splits, stages, n_layer)


def _table(c: LayerCosts, stages: Sequence[int]) -> str:
    from dgr.protocol.ranges import split_layers

    lines = [f"{os.path.basename(c.model)}: {c.n_layer} layers at batch {c.batch} after "
             f"{c.context} tokens, on {c.machine.get('cpu') or '?'} ({c.machine.get('device')}, "
             f"{c.settings.get('n_threads', 1)} thread(s), "
             + ", ".join(f"{k}={v}" for k, v in c.settings.items() if k != "n_threads") + ")"
             + (" [cached]" if c.cached else f", timed in {c.seconds:.1f} s"),
             f"a forward's fixed cost {c.overhead_ms:.3f} ms (layers {c.chunk[0]}-"
             f"{c.chunk[1] - 1} together: {c.chunk_ms:.3f} ms)", "",
             "layer  ms/forward", *(f"{i:5d}  {ms:.3f}" + ("  (with the embedding)" if i == 0
                                                        else "  (with the head)"
                                                        if i == c.n_layer - 1 else "")
                                    for i, ms in enumerate(c.layer_ms))]
    for n in stages:
        if not 1 <= n <= c.n_layer:
            continue
        for name, rr in (("measured", plan([c] * n)), ("even", split_layers(c.n_layer, n))):
            ms = [c.stage_ms(a, b) for a, b in rr]
            lines.append(f"{n} stages, {name}: " + " ".join(f"[{a},{b})" for a, b in rr)
                         + "  ms/forward " + " ".join(f"{m:.2f}" for m in ms)
                         + f"  (slowest/fastest {max(ms) / min(ms):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m dgr layer-costs``."""
    import argparse

    from dgr.protocol import settings as engine_settings

    ap = argparse.ArgumentParser(
        prog="python -m dgr layer-costs",
        description="Time each layer of a model on this machine (an engine of each single "
                    "layer, decode steps of --batch rows after --context tokens), print the "
                    "times and the stage ranges that balance them. The figures are cached "
                    "per machine ($DGR_CACHE/layer-costs/); --splits cost (run, serve, "
                    "parity) and the capability record use them.")
    ap.add_argument("--model", help="GGUF path (default: the registry's default model)")
    ap.add_argument("--batch", type=int, default=1,
                    help="rows per forward: the sessions a stage computes at once (default 1)")
    ap.add_argument("--context", type=int, default=64,
                    help="tokens in each slot before the timed steps (default 64)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per engine (the fastest is taken)")
    ap.add_argument("--stages", default="2,3", help="stage counts to plan (default 2,3)")
    ap.add_argument("--no-cache", action="store_true", help="measure again")
    ap.add_argument("--json", action="store_true", help="print the measurement as JSON")
    engine_settings.add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        from dgr.artifacts import models

        model = args.model or str(models.path(models.DEFAULT_MODEL))
        stages = [int(x) for x in args.stages.split(",") if x.strip()]
        settings = engine_settings.from_args(args)
        if "--slots" not in engine_settings.given(args):  # room for the rows measured
            settings["n_slots"] = max(settings["n_slots"], args.batch)
        c = measure(model, batch=args.batch, context=args.context, steps=args.steps,
                    settings=settings, use_cache=not args.no_cache)
    except (errors.DgrError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(c.to_json(), indent=1) if args.json else _table(c, stages))
    return 0
