"""gRPC transport of dgr: the shard service (server side) and its client, over grpc.aio.

- ``dgr.transport.server.ShardServer``: serves a stage backend (``dgr.worker.Worker``): the
  ``dgr.v1.Shard`` control RPCs (proto/dgr.proto), the raw-frame ``Step`` stream, and the
  standard ``grpc.health.v1`` service.
- ``dgr.transport.client.ShardClient`` / ``StepStream``: calls with deadlines, keepalive and
  message limits; a step stream per route session.
- ``dgr.transport.status``: the one table between ``dgr.errors`` classes and gRPC status codes.
- ``dgr.transport.common``: names, limits, channel/server options, ``StageInfo``.
- ``python -m dgr.transport.codegen``: regenerates ``dgr/_proto`` from ``proto/dgr.proto``.
"""
