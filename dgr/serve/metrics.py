"""Prometheus metrics of the HTTP front (``GET /metrics``), in their own registry."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["ServeMetrics"]


class ServeMetrics:
    """Requests by endpoint and HTTP status, generated tokens, time to first token, decode-loop
    trips and speculative drafts (sent, accepted: their ratio is the acceptance), the queue of
    requests waiting for a slot (its length, their waits, those refused full or timed out); with API
    keys, each key's generation requests in flight and those refused at its cap, labelled by
    the key's name (never its secret)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._requests = Counter("dgr_serve_requests", "HTTP completion requests answered",
                                 ["endpoint", "status"], registry=self.registry)
        self._tokens = Counter("dgr_serve_completion_tokens",
                               "Tokens generated for completion requests",
                               registry=self.registry)
        self._ttft = Histogram("dgr_serve_time_to_first_token_seconds",
                               "From a request's arrival to its first generated token",
                               buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                               registry=self.registry)
        self._key_in_flight = Gauge("dgr_serve_key_requests_in_flight",
                                    "Generation requests in flight by API key name", ["key"],
                                    registry=self.registry)
        self._trips = Counter("dgr_serve_decode_trips",
                              "Decode-loop ring trips of completion requests (each makes one "
                              "token, or more with speculative decoding)",
                              registry=self.registry)
        self._drafted = Counter("dgr_serve_speculative_drafts",
                                "Draft tokens sent around the ring (speculative decoding)",
                                registry=self.registry)
        self._accepted = Counter("dgr_serve_speculative_drafts_accepted",
                                 "Draft tokens the ring accepted (speculative decoding)",
                                 registry=self.registry)
        self._key_refused = Counter("dgr_serve_key_requests_refused",
                                    "Generation requests refused (429) at their API key's cap "
                                    "of requests in flight", ["key"], registry=self.registry)
        self._queue_length = Gauge("dgr_serve_queue_length",
                                   "Generation requests waiting for a free slot",
                                   registry=self.registry)
        self._queue_wait = Histogram("dgr_serve_queue_wait_seconds",
                                     "How long a generation request waited for its slots (0: "
                                     "one was free)",
                                     buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                                              300, 600), registry=self.registry)
        self._queue_refused = Counter("dgr_serve_queue_refused",
                                      "Generation requests refused (429) with the queue full",
                                      registry=self.registry)
        self._queue_timeouts = Counter("dgr_serve_queue_timeouts",
                                       "Generation requests that waited their --queue-timeout "
                                       "in the queue without a slot (503)",
                                       registry=self.registry)

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()

    def tokens(self, n: int) -> None:
        self._tokens.inc(n)

    def speculation(self, trips: int, drafted: int, accepted: int) -> None:
        """A request's decode-loop trips, drafts sent and drafts accepted."""
        self._trips.inc(trips)
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def key_in_flight(self, key: str, n: int) -> None:
        self._key_in_flight.labels(key=key).set(n)

    def key_refused(self, key: str) -> None:
        self._key_refused.labels(key=key).inc()

    def queue_length(self, n: int) -> None:
        self._queue_length.set(n)

    def queued(self, seconds: float) -> None:
        """A request got its slots after ``seconds`` (0: at once)."""
        self._queue_wait.observe(seconds)

    def queue_refused(self) -> None:
        self._queue_refused.inc()

    def queue_timed_out(self) -> None:
        self._queue_timeouts.inc()

    def watch_prefix(self, pool) -> None:
        """Export the prompt cache's counts (``dgr.serve.prefix.PrefixPool``) at each scrape."""
        self.registry.register(_PrefixCollector(pool))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCollector:
    """The prompt cache's counts, read from the pool when scraped."""

    def __init__(self, pool):
        self.pool = pool

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.pool
        for name, doc, v in (
                ("dgr_serve_prompt_cache_hits", "Requests that reused a kept session's prefix",
                 p.hits),
                ("dgr_serve_prompt_cache_misses", "Requests the prompt cache had no prefix for",
                 p.misses),
                ("dgr_serve_prompt_cache_evictions",
                 "Kept sessions closed to free a slot, or idle past the cache's ttl",
                 p.evictions),
                ("dgr_serve_prompt_cache_tokens_reused",
                 "Prompt tokens not prefilled again (reused from a kept session)",
                 p.tokens_reused),
                ("dgr_serve_prompt_cache_rows_reused",
                 "Of those, the tokens past whole n_ubatch chunks (rows of partial chunks)",
                 p.rows_reused),
                ("dgr_serve_prefix_store_hits",
                 "Requests that adopted a prefix from the stages' prefix stores", p.store_hits),
                ("dgr_serve_prefix_store_tokens_reused",
                 "Prompt tokens not prefilled again (adopted from the stages' prefix stores)",
                 p.store_tokens_reused)):
            yield CounterMetricFamily(name, doc, value=v)
        yield GaugeMetricFamily("dgr_serve_prompt_cache_sessions",
                                "Sessions the prompt cache keeps now (each holds a slot)",
                                value=len(p))
        yield GaugeMetricFamily("dgr_serve_prompt_cache_bytes",
                                "KV cache the kept sessions' positions fill, over every stage",
                                value=p.bytes_held())
