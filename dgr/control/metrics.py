"""Optional Prometheus metrics of a worker (``python -m dgr.worker --metrics-port N``).

The figures of the capability record (``dgr.capability``), in the Prometheus text exposition
format 0.0.4, with base units (seconds, bytes) and ``_total`` only on counters. Served by the
standard library's ``http.server`` from a daemon thread: the format is a few lines of text, so
this avoids a dependency (``prometheus_client``) for ~60 lines. The record is built on the
worker's event loop (its session table is not shared across threads).
"""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["exposition", "MetricsServer", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}" if d else ""


def exposition(rec, counters: dict | None = None) -> str:
    """The text exposition of a ``dgr.capability.Capability``, and of the worker's compute
    totals when given (``counters``: ``dgr.worker.Worker.compute_counters()``)."""
    out: list[str] = []

    def metric(name, kind, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            out.append(f"{name}{_labels(labels)} {float(value)!r}")

    c, cap, ld, s, h = rec.compatibility, rec.capacity, rec.load, rec.seam, rec.health
    metric("dgr_worker_info", "gauge", "Model and build this worker serves (value 1).", [(
        dict(model_identity=c.model_identity, model_name=c.model_name, arch=c.arch,
             quantisation=c.quantisation, backend=c.backend, llama_cpp_commit=c.llama_cpp_commit,
             patch_stack_hash=c.patch_stack_hash, dgr_version=c.dgr_version,
             stage_identity=c.stage_identity, boundary_schema_version=c.boundary_schema_version),
        1)])
    metric("dgr_worker_layer_start", "gauge", "First owned layer.", [({}, cap.layer_start)])
    metric("dgr_worker_layer_end", "gauge", "End of the owned range (exclusive).",
           [({}, cap.layer_end)])
    metric("dgr_worker_boundary_width", "gauge", "Floats per token at the boundary.",
           [({}, c.boundary_width)])
    metric("dgr_worker_slots", "gauge", "Session slots.", [({}, cap.slots_total)])
    metric("dgr_worker_slots_free", "gauge", "Free session slots.", [({}, cap.slots_free)])
    metric("dgr_worker_context_tokens", "gauge", "Context tokens over all slots.",
           [({}, cap.context_tokens_total)])
    metric("dgr_worker_context_tokens_free", "gauge", "Free context tokens over all slots.",
           [({}, cap.context_tokens_free)])
    metric("dgr_worker_memory_bytes", "gauge", "Memory of the owned range.",
           [({"kind": "weights"}, cap.weight_bytes), ({"kind": "kv_cache"}, cap.kv_bytes)])
    metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
           [({}, cap.rss_bytes)])
    metric("dgr_worker_queue_depth", "gauge", "Steps waiting for the engine.",
           [({}, ld.queue_depth)])
    metric("dgr_worker_in_flight_steps", "gauge", "Steps admitted and not yet answered.",
           [({}, ld.in_flight_steps)])
    metric("dgr_worker_sessions", "gauge", "Sessions holding a slot.", [({}, ld.sessions)])
    metric("dgr_worker_tokens_per_second", "gauge",
           f"Tokens computed per second over the last {ld.window_s:g} s.", [({}, ld.tokens_per_s)])
    metric("dgr_worker_boundary_bytes_per_token", "gauge",
           "Boundary payload bytes per token, per codec (in: accepted, out: sent).",
           [({"codec": k, "direction": "in"}, v) for k, v in s.boundary_bytes_per_token.items()]
           + [({"codec": k, "direction": "out"}, v) for k, v in s.output_bytes_per_token.items()])
    metric("dgr_worker_hop_latency_seconds", "summary",
           "Frame arrival to reply ready at this worker, single-token steps (recent).",
           [({"quantile": "0.5"}, s.hop_latency_ms_p50 / 1e3),
            ({"quantile": "0.99"}, s.hop_latency_ms_p99 / 1e3)])
    out.append(f"dgr_worker_hop_latency_seconds_count {float(s.hop_samples)!r}")
    metric("dgr_worker_uptime_seconds", "gauge", "Seconds since the worker started.",
           [({}, h.uptime_s)])
    metric("dgr_worker_draining", "gauge", "1 while draining (shutting down).",
           [({}, int(h.draining))])
    metric("dgr_worker_steps_total", "counter", "Steps served.", [({}, h.steps_served)])
    metric("dgr_worker_step_failures_total", "counter", "Steps refused or failed.",
           [({}, h.steps_failed)])
    metric("dgr_worker_engine_restarts_total", "counter", "Engine reloads in this process.",
           [({}, h.engine_restarts)])
    if counters is not None:
        metric("dgr_worker_decode_steps_total", "counter", "Single-token steps computed.",
               [({}, counters["decode_steps_total"])])
        metric("dgr_worker_decode_compute_seconds_total", "counter",
               "Engine compute time of single-token steps (sampling and transport excluded).",
               [({}, counters["decode_compute_s_total"])])
        metric("dgr_worker_tokens_computed_total", "counter", "Tokens computed, every step.",
               [({}, counters["tokens_computed_total"])])
        metric("dgr_worker_compute_seconds_total", "counter",
               "Engine compute time of every step (sampling and transport excluded).",
               [({}, counters["compute_s_total"])])
    metric("dgr_worker_certified_lane", "gauge", "A certified lane this worker advertises.",
           [({"lane_id": ln.lane_id, "codec": ln.codec,
              "stages": ",".join(f"{a}:{b}" for a, b in ln.stages)}, 1) for ln in rec.lanes])
    metric("dgr_worker_uncertified_lanes", "gauge",
           "Lanes in the store that do not match this worker.", [({}, len(rec.uncertified))])
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` for a ``dgr.worker.Worker`` whose event loop is running now.

    Create it on the worker's loop (it remembers it); ``address`` is ``host:port`` once started.
    """

    def __init__(self, worker, host: str = "127.0.0.1", port: int = 0, loop=None):
        self.worker = worker
        self.loop = loop or asyncio.get_running_loop()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                try:
                    body = outer.render().encode()
                except Exception as e:  # noqa: BLE001
                    self.send_error(503, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: scrapes are not session events
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dgr-metrics",
                                        daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def render(self) -> str:
        async def build():
            return self.worker.capability(), self.worker.compute_counters()

        rec, counters = asyncio.run_coroutine_threadsafe(build(), self.loop).result(10)
        return exposition(rec, counters)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
