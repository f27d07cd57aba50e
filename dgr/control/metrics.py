"""Prometheus metrics of a worker (``python -m dgr.worker --metrics-port N``).

The figures of the capability record (``dgr.control.capability``) and the worker's exact compute
totals, exposed through ``prometheus_client``: a collector builds them from one fresh record per
scrape (base units, seconds and bytes; counters end in ``_total``), and the library's HTTP server
serves them from a daemon thread in the text exposition format. The record is built on the
worker's event loop (its session table belongs to that loop and its data-plane threads).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = ["families", "exposition", "MetricsServer", "CONTENT_TYPE"]

#: The exposition format served (text 0.0.4, what every Prometheus version scrapes)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def _gauge(name: str, help_: str, value=None, labels: dict | None = None,
           samples: list[tuple[dict, float]] | None = None) -> GaugeMetricFamily:
    if samples is None:
        return GaugeMetricFamily(name, help_, value=float(value))
    keys = list(dict.fromkeys(k for lab, _ in samples for k in lab))  # first-seen order
    g = GaugeMetricFamily(name, help_, labels=keys)
    for lab, v in samples:
        g.add_metric([str(lab.get(k, "")) for k in keys], float(v))
    return g


def _counter(name: str, help_: str, value) -> CounterMetricFamily:
    # prometheus_client appends the _total suffix
    return CounterMetricFamily(name.removesuffix("_total"), help_, value=float(value))


def families(rec, counters: dict | None = None, profile: dict | None = None) -> list[Metric]:
    """The metric families of a capability record (``dgr.protocol.capability.Capability``),
    of the worker's compute totals when given (``StagePipeline.compute_counters()``), and of where
    its time went (``Worker.profile_snapshot()``)."""
    c, cap, ld, s, h = rec.compatibility, rec.capacity, rec.load, rec.seam, rec.health
    info = InfoMetricFamily("dgr_worker", "Model and build this worker serves.")
    info.add_metric([], dict(
        model_identity=c.model_identity, model_name=c.model_name, arch=c.arch,
        quantisation=c.quantisation, backend=c.backend, llama_cpp_commit=c.llama_cpp_commit,
        patch_stack_hash=c.patch_stack_hash, dgr_version=c.dgr_version,
        stage_identity=c.stage_identity, boundary_schema_version=str(c.boundary_schema_version)))
    hop = Metric("dgr_worker_hop_latency_seconds",
                 "Frame arrival to reply ready at this worker, single-token steps (recent).",
                 "summary")
    hop.add_sample("dgr_worker_hop_latency_seconds", {"quantile": "0.5"},
                   s.hop_latency_ms_p50 / 1e3)
    hop.add_sample("dgr_worker_hop_latency_seconds", {"quantile": "0.99"},
                   s.hop_latency_ms_p99 / 1e3)
    hop.add_sample("dgr_worker_hop_latency_seconds_count", {}, float(s.hop_samples))
    out: list[Metric] = [
        info,
        _gauge("dgr_worker_layer_start", "First owned layer.", cap.layer_start),
        _gauge("dgr_worker_layer_end", "End of the owned range (exclusive).", cap.layer_end),
        _gauge("dgr_worker_boundary_width", "Floats per token at the boundary.",
               c.boundary_width),
        _gauge("dgr_worker_slots", "Session slots.", cap.slots_total),
        _gauge("dgr_worker_slots_free", "Free session slots.", cap.slots_free),
        _gauge("dgr_worker_context_tokens", "Context tokens over all slots.",
               cap.context_tokens_total),
        _gauge("dgr_worker_context_tokens_free", "Free context tokens over all slots.",
               cap.context_tokens_free),
        _gauge("dgr_worker_memory_bytes", "Memory of the owned range.",
               samples=[({"kind": "weights"}, cap.weight_bytes),
                        ({"kind": "kv_cache"}, cap.kv_bytes)]),
        _gauge("process_resident_memory_bytes", "Resident memory size in bytes.",
               cap.rss_bytes),
        _gauge("dgr_worker_queue_depth", "Steps waiting for the engine.", ld.queue_depth),
        _gauge("dgr_worker_in_flight_steps", "Steps admitted and not yet answered.",
               ld.in_flight_steps),
        _gauge("dgr_worker_sessions", "Sessions holding a slot.", ld.sessions),
        _gauge("dgr_worker_tokens_per_second",
               f"Tokens computed per second over the last {ld.window_s:g} s.", ld.tokens_per_s),
        _gauge("dgr_worker_boundary_bytes_per_token",
               "Boundary payload bytes per token, per codec (in: accepted, out: sent).",
               samples=[({"codec": k, "direction": "in"}, v)
                        for k, v in s.boundary_bytes_per_token.items()]
               + [({"codec": k, "direction": "out"}, v)
                  for k, v in s.output_bytes_per_token.items()]),
        hop,
        _gauge("dgr_worker_uptime_seconds", "Seconds since the worker started.", h.uptime_s),
        _gauge("dgr_worker_draining", "1 while draining (shutting down).", int(h.draining)),
        _counter("dgr_worker_steps_total", "Steps served.", h.steps_served),
        _counter("dgr_worker_step_failures_total", "Steps refused or failed.", h.steps_failed),
    ]
    ps = rec.prefix_store
    if ps is not None:
        out += [
            _gauge("dgr_worker_prefix_store_size", "Entries the prefix store may hold (ended "
                   "sessions' caches kept for later ones; 0: none).", ps.size),
            _gauge("dgr_worker_prefix_store_entries", "Entries it holds (each on a slot no "
                   "session holds).", ps.entries),
            _gauge("dgr_worker_prefix_store_positions", "Positions they hold, summed.",
                   ps.positions),
            _gauge("dgr_worker_prefix_store_bytes", "The KV cache those positions fill.",
                   ps.bytes),
            _counter("dgr_worker_prefix_store_hits", "New sessions that adopted an entry.",
                     ps.hits),
            _counter("dgr_worker_prefix_store_misses", "New sessions that asked and found "
                     "none.", ps.misses),
            _counter("dgr_worker_prefix_store_evictions", "Entries dropped for a session's "
                     "slot, by age, or replaced by a longer one.", ps.evictions),
        ]
    if counters is not None:
        out += [
            _counter("dgr_worker_decode_steps_total", "Single-token steps computed.",
                     counters["decode_steps_total"]),
            _counter("dgr_worker_decode_compute_seconds_total",
                     "Engine compute time of single-token steps (sampling and transport "
                     "excluded).", counters["decode_compute_s_total"]),
            _counter("dgr_worker_tokens_computed_total", "Tokens computed, every step.",
                     counters["tokens_computed_total"]),
            _counter("dgr_worker_compute_seconds_total",
                     "Engine compute time of every step (sampling and transport excluded).",
                     counters["compute_s_total"]),
        ]
    if profile is not None:
        parts = CounterMetricFamily(
            "dgr_worker_stage_seconds", "Wall seconds by part of the stage's work, summed over "
            "its threads (docs/performance.md).", labels=["part"])
        for part, v in profile["parts"].items():
            parts.add_metric([part], float(v))
        out += [parts,
                _counter("process_cpu_seconds_total", "Total user and system CPU time spent "
                         "in seconds.", profile["cpu_s"]),
                _counter("dgr_worker_batches_total", "Forwards the stage loop ran.",
                         profile["batches"]),
                _counter("dgr_worker_batched_steps_total", "Steps in those forwards.",
                         profile["steps_batched"])]
        eng = profile["engine"]
        if eng:
            out += [
                _counter("dgr_engine_forwards_total", "Engine forwards completed.",
                         eng["forwards"]),
                _counter("dgr_engine_decodes_total", "llama_decode calls.", eng["decodes"]),
                _counter("dgr_engine_ubatches_total", "llama.cpp ubatches of those decodes "
                         "(one per run of consecutive slots).", eng["ubatches"]),
                _counter("dgr_engine_graphs_reused_total", "ubatches that reused llama.cpp's "
                         "previous graph.", eng["graphs_reused"]),
                _counter("dgr_engine_forward_seconds_total", "Wall seconds in the engine's "
                         "forward.", eng["forward_s"]),
                _counter("dgr_engine_decode_seconds_total", "Of which in llama_decode.",
                         eng["decode_s"]),
            ]
    out += [
        _gauge("dgr_worker_certified_lane", "A certified lane this worker advertises.",
               samples=[({"lane_id": ln.lane_id, "codec": ln.codec,
                          "stages": ",".join(f"{a}:{b}" for a, b in ln.stages)}, 1)
                        for ln in rec.lanes]),
        _gauge("dgr_worker_uncertified_lanes",
               "Lanes in the store that do not match this worker.", len(rec.uncertified)),
    ]
    return out


class _Collector:
    """A prometheus_client collector: one fresh capability record per scrape."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        yield from families(*self.snapshot())


def exposition(rec, counters: dict | None = None) -> str:
    """The text exposition of a capability record (and compute totals), as a scrape sees it."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(lambda: (rec, counters)))
    return generate_latest(reg).decode()


class MetricsServer:
    """``GET /metrics`` for a ``dgr.worker.Worker`` whose event loop is running now.

    Create it on the worker's loop (it remembers it), or pass ``loop``; ``start()`` serves it
    on ``host:port`` (0: any free port) and ``address`` says where; ``render()`` is one scrape.
    """

    def __init__(self, worker, host: str = "127.0.0.1", port: int = 0, loop=None):
        self.worker = worker
        self.loop = loop or asyncio.get_running_loop()
        self.host, self.port = host, port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self._snapshot))
        self.httpd = None
        self._thread = None

    def _snapshot(self):
        async def build():
            return (self.worker.capability(), self.worker.pipeline.compute_counters(),
                    self.worker.profile_snapshot())

        return asyncio.run_coroutine_threadsafe(build(), self.loop).result(10)

    @property
    def address(self) -> str:
        if self.httpd is None:
            raise RuntimeError("the metrics server is not started")
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def start(self) -> MetricsServer:
        self.httpd, self._thread = start_http_server(self.port, self.host, self.registry)
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self._thread.join(5)
