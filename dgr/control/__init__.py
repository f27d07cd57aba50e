"""What a tracker reads from a worker: the capability record, the certification store, the
Prometheus metrics, and split-versus-whole parity reports."""
