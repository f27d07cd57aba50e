"""gRPC transport of dgr and its TCP data plane: bytes between processes, no domain logic.

- ``dgr.transport.server.ShardServer``: serves a stage backend (``dgr.worker.worker.Worker``):
  the ``dgr.v1.Shard`` control RPCs (proto/dgr.proto), the raw-frame ``Step`` stream, and the
  standard ``grpc.health.v1`` service.
- ``dgr.transport.client.ShardClient`` / ``StepStream``: calls with deadlines, keepalive and
  message limits; a step stream per route session.
- ``dgr.transport.dataplane``: the TCP data plane (length-prefixed frames, relay links).
- ``dgr.transport.status``: the one table between ``dgr.errors`` classes and gRPC status codes.
- ``dgr.transport.common``: service names, limits, channel and server options.
- ``python -m dgr.transport.codegen``: regenerates ``dgr/_proto`` from ``proto/dgr.proto``.
"""
